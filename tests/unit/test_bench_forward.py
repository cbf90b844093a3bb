"""bench/bench_forward.py: the step-cost curve through the engine's own runners."""

from __future__ import annotations

import argparse

import pytest
import torch
from bench.bench_forward import (
    eager_runners,
    loop_ratios,
    main,
    measure,
    paired_ratios,
    parse_tokens,
    prefill,
    summarize,
    transformers_runners,
)
from tools.tiny_models import as_loaded, build_pair

from specpair_runtime.config import SpeculationKnobs
from specpair_runtime.engine.graphs import GraphStep
from specpair_runtime.engine.options import EngineOptions
from specpair_runtime.engine.speculative import SpeculativeEngine

CONTEXT = 16


def test_tokens_always_include_the_one_token_baseline() -> None:
    assert parse_tokens("8,4, 4") == [1, 4, 8]


@pytest.mark.parametrize("text", ["0,4", "four", ""])
def test_bad_tokens_name_the_flag(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_tokens(text)
    with pytest.raises(SystemExit):
        main(["--tokens", text])
    assert "argument --tokens:" in capsys.readouterr().err


def test_summary_takes_ratios_within_each_round() -> None:
    rows = summarize({"target": {1: [1.0, 2.0, 1.0], 4: [1.2, 2.0, 1.1]}})
    one, four = rows
    assert (one.tokens, one.ratio, one.ratio_min, one.ratio_max) == (1, 1.0, 1.0, 1.0)
    assert four.ms == pytest.approx(1200.0)
    assert (four.ratio, four.ratio_min, four.ratio_max) == pytest.approx((1.1, 1.0, 1.2))


def _tiny_engine() -> SpeculativeEngine:
    pair = build_pair("llama", seed=0)
    return SpeculativeEngine(
        as_loaded(pair.target, pair.tokenizer, "target"),
        as_loaded(pair.draft, pair.tokenizer, "draft"),
        SpeculationKnobs(),
        options=EngineOptions(max_slots=1, max_length=32),
    )


def test_measure_times_every_size_and_keeps_the_context() -> None:
    engine = _tiny_engine()
    assert engine.draft is not None
    runners = {"target": engine.target, "draft": engine.draft}
    storage = engine.target.storage
    assert storage is not None
    with torch.inference_mode():
        prefill(engine.target, CONTEXT)
    context = storage.tensor[..., :CONTEXT, :].clone()
    every = {name: [1, 3, 5] for name in runners}
    samples = measure(runners, every, context=CONTEXT, rounds=2, repeats=2)
    assert set(samples) == {"target", "draft"}
    for by_size in samples.values():
        assert set(by_size) == {1, 3, 5}
        assert all(len(v) == 2 and min(v) > 0 for v in by_size.values())
    # Timed forwards write only past the context (rolled back by length), never into it.
    assert torch.equal(storage.tensor[..., :CONTEXT, :], context)
    assert engine.target.storage is storage


def test_measure_times_only_the_sizes_named_for_each_model() -> None:
    engine = _tiny_engine()
    assert engine.draft is not None
    runners = {"target": engine.target, "draft": engine.draft}
    sizes = {"target": [1, 2, 3], "draft": [1]}
    samples = measure(runners, sizes, context=CONTEXT, rounds=1, repeats=1)
    assert {name: sorted(by_size) for name, by_size in samples.items()} == sizes


def test_rounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="rounds"):
        measure({}, {}, context=CONTEXT, rounds=0)


def test_transformers_forward_runners_share_the_modules_and_give_ratios() -> None:
    engine = _tiny_engine()
    assert engine.draft is not None
    runners = {"target": engine.target, "draft": engine.draft}
    others = transformers_runners(runners, 32)
    assert set(others) == {"target-hf", "draft-hf"}
    hf = others["target-hf"]
    assert hf.decoder is None and engine.target.decoder is not None
    assert hf.model is engine.target.model and hf.storage is not engine.target.storage
    samples = {"target": {1: [1.0, 3.0]}, "target-hf": {1: [2.0, 3.0]}, "draft": {1: [1.0]}}
    assert loop_ratios(samples) == [("target", 1, 0.75, 0.5, 1.0)]


def test_eager_baselines_only_for_graph_stepping_models() -> None:
    engine = _tiny_engine()
    assert engine.draft is not None
    runners = {"target": engine.target, "draft": engine.draft}
    assert eager_runners(runners, 32) == {}  # the CPU runs no graph steps
    engine.target.graphs = GraphStep(engine.target, compile=True)
    eager = eager_runners(runners, 32)
    assert set(eager) == {"target-eager"}
    baseline = eager["target-eager"]
    assert baseline.graphs is None and baseline.model is engine.target.model
    assert baseline.storage is not engine.target.storage
    samples = {"target": {1: [1.0, 1.0]}, "target-eager": {1: [4.0, 2.0]}}
    assert paired_ratios(samples, "-eager") == [("target", 1, 0.375, 0.25, 0.5)]


def test_forwards_of_several_rows_keep_every_rows_context() -> None:
    pair = build_pair("llama", seed=0)
    engine = SpeculativeEngine(
        as_loaded(pair.target, pair.tokenizer, "target"),
        None,
        SpeculationKnobs(),
        options=EngineOptions(max_slots=3, max_length=32),
    )
    storage = engine.target.storage
    assert storage is not None
    with torch.inference_mode():
        prefill(engine.target, CONTEXT, rows=3)
    context = storage.tensor[..., :CONTEXT, :].clone()
    # Every row's slot holds the same context (one prompt, three slots).
    assert torch.equal(context[:, :, 0], context[:, :, 2])
    samples = measure(
        {"target": engine.target}, {"target": [1, 4]}, context=CONTEXT, rounds=1, repeats=1, rows=3
    )
    assert set(samples["target"]) == {1, 4}
    assert torch.equal(storage.tensor[..., :CONTEXT, :], context)
