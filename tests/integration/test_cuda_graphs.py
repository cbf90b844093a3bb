"""CUDA graphs for decode/verify steps: captured, replayed, and the same greedy tokens."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from tools.tiny_models import as_loaded, build_pair

from specpair_runtime.config import SpeculationKnobs
from specpair_runtime.engine.api import SamplingParams
from specpair_runtime.engine.graphs import GraphStep, row_bucket
from specpair_runtime.engine.options import EngineOptions
from specpair_runtime.engine.speculative import SpeculativeEngine, generate

TEXTS = ["Hello, how can I help", "My order has not", "def add(a, b):\n    return", "x"]
GREEDY = SamplingParams(max_new_tokens=24)
FIXED = SpeculationKnobs(max_depth=3, min_depth=3, adaptive=False)


def test_row_buckets_are_powers_of_two() -> None:
    assert [row_bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]


@pytest.mark.cuda
def test_graph_steps_give_the_eager_greedy_tokens() -> None:
    pair = build_pair("llama", seed=0)
    tok = pair.tokenizer
    cuda = torch.device("cuda")
    pair.target.to(cuda)  # type: ignore[arg-type]
    pair.draft.to(cuda)  # type: ignore[arg-type]
    target = dataclasses.replace(as_loaded(pair.target, tok, "t"), device=cuda)
    draft = dataclasses.replace(as_loaded(pair.draft, tok, "d"), device=cuda)
    prompts = [tok(t)["input_ids"] for t in TEXTS]

    def run(graphs: bool, with_draft: bool) -> list[list[int]]:
        options = EngineOptions(max_slots=4, max_length=128, cuda_graphs=graphs)
        engine = SpeculativeEngine(target, draft if with_draft else None, FIXED, options=options)
        assert (engine.target.graphs is not None) == graphs
        return [r.token_ids for r in generate(engine, prompts, GREEDY)]

    eager = run(graphs=False, with_draft=False)
    assert run(graphs=True, with_draft=False) == eager
    assert run(graphs=True, with_draft=True) == eager


def test_the_graph_step_logic_runs_eagerly_on_the_cpu() -> None:
    """Bucketed rows, scratch-slot padding and dense attention, without the compiler.

    The graph path's function runs uncompiled here (capture needs CUDA), so
    its shapes and padding are checked on every machine.
    """
    pair = build_pair("llama", seed=0)
    tok = pair.tokenizer
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    options = EngineOptions(max_slots=4, max_length=128)
    eager = SpeculativeEngine(as_loaded(pair.target, tok, "t"), None, FIXED, options=options)
    expected = [r.token_ids for r in generate(eager, prompts, GREEDY)]
    engine = SpeculativeEngine(
        as_loaded(pair.target, tok, "t"), as_loaded(pair.draft, tok, "d"), FIXED, options=options
    )
    assert engine.draft is not None
    used: list[int] = []
    for runner in (engine.target, engine.draft):
        step = GraphStep(runner)

        def uncompiled(*args: Any, _step: GraphStep = step) -> torch.Tensor:
            used.append(args[1].shape[0])  # rows after padding
            return _step._forward(*args)

        step._compiled = uncompiled  # type: ignore[assignment]
        runner.graphs = step
    assert [r.token_ids for r in generate(engine, prompts, GREEDY)] == expected
    assert used and all(n == row_bucket(n) for n in used)  # only bucketed shapes
