"""CUDA graphs for decode/verify steps: captured, replayed, and the same greedy tokens."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tools.tiny_models import as_loaded, build_pair
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._functorch._aot_autograd.utils import make_boxed_func
from torch._guards import TracingContext

from specpair_runtime.config import SpeculationKnobs
from specpair_runtime.engine.api import SamplingParams
from specpair_runtime.engine.graphs import (
    DYNAMIC_SHAPES,
    MAX_GRAPH_TOKENS_PER_ROW,
    GraphStep,
    graph_shapes,
    row_bucket,
    step_shapes,
)
from specpair_runtime.engine.loading import LoadedModel
from specpair_runtime.engine.options import EngineOptions
from specpair_runtime.engine.speculative import SpeculativeEngine, generate
from specpair_runtime.server.readiness import Readiness
from specpair_runtime.server.startup import warm_up_graphs

TEXTS = ["Hello, how can I help", "My order has not", "def add(a, b):\n    return", "x"]
GREEDY = SamplingParams(max_new_tokens=24)
FIXED = SpeculationKnobs(max_depth=3, min_depth=3, adaptive=False)


def test_row_buckets_are_powers_of_two() -> None:
    assert [row_bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]


def test_graph_shapes_count_every_bucket_and_verify_length() -> None:
    assert graph_shapes(1) == 17  # one row: 1..17 tokens (depth 16 + 1)
    assert graph_shapes(5) == 4 * 17  # buckets 1, 2, 4, 8
    assert graph_shapes(8) == 4 * 17


def tiny_pair_on_cuda() -> tuple[LoadedModel, LoadedModel, list[list[int]]]:
    """The tiny pair on the GPU: (target, draft, the prompts of ``TEXTS``)."""
    pair = build_pair("llama", seed=0)
    tok = pair.tokenizer
    cuda = torch.device("cuda")
    pair.target.to(cuda)  # type: ignore[arg-type]
    pair.draft.to(cuda)  # type: ignore[arg-type]
    target = dataclasses.replace(as_loaded(pair.target, tok, "t"), device=cuda)
    draft = dataclasses.replace(as_loaded(pair.draft, tok, "d"), device=cuda)
    return target, draft, [tok(t)["input_ids"] for t in TEXTS]


def cpu_engines(
    options: EngineOptions, knobs: SpeculationKnobs = FIXED
) -> tuple[SpeculativeEngine, SpeculativeEngine, Any]:
    """The tiny pair on the CPU: (target-only engine, pair engine, tokenizer).

    The pair engine runs plain linears, as on CUDA, so that a test can
    install graph steps on its runners; the target-only one gives the
    expected tokens.
    """
    pair = build_pair("llama", seed=0)
    tok = pair.tokenizer
    eager = SpeculativeEngine(as_loaded(pair.target, tok, "t"), None, knobs, options=options)
    engine = SpeculativeEngine(
        as_loaded(pair.target, tok, "t", cpu_kernels="default"),
        as_loaded(pair.draft, tok, "d", cpu_kernels="default"),
        knobs,
        options=options,
    )
    assert engine.draft is not None
    return eager, engine, tok


RECORDING = [pytest.param(False, id="capture"), pytest.param(True, id="compile")]


@pytest.mark.cuda
@pytest.mark.parametrize("compile", RECORDING)
def test_graph_steps_give_the_eager_greedy_tokens(compile: bool) -> None:
    target, draft, prompts = tiny_pair_on_cuda()

    def run(graphs: bool, with_draft: bool) -> list[list[int]]:
        options = EngineOptions(
            max_slots=4, max_length=128, cuda_graphs=graphs, cuda_graph_compile=compile
        )
        engine = SpeculativeEngine(target, draft if with_draft else None, FIXED, options=options)
        assert (engine.target.graphs is not None) == graphs
        return [r.token_ids for r in generate(engine, prompts, GREEDY)]

    eager = run(graphs=False, with_draft=False)
    counters.clear()
    assert run(graphs=True, with_draft=False) == eager
    assert run(graphs=True, with_draft=True) == eager
    # Captured for real: cudagraph trees log a skip (mutated inputs, CPU ops, ...) and
    # then run the compiled step uncaptured, which would still give the same tokens.
    assert counters["inductor"]["cudagraph_skips"] == 0


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
        step = GraphStep(runner, compile=True)

        def uncompiled(*args: Any, _step: GraphStep = step) -> torch.Tensor:
            used.append(args[1].shape[0])  # rows after padding
            return _step._forward(*args)

        step._compiled = uncompiled  # type: ignore[assignment]
        runner.graphs = step
    assert [r.token_ids for r in generate(engine, prompts, GREEDY)] == expected
    assert used and all(n == row_bucket(n) for n in used)  # only bucketed shapes


@pytest.mark.parametrize("warm", [True, False], ids=["warmed-up", "lazily"])
def test_captured_shapes_replay_from_their_static_buffers(warm: bool) -> None:
    """The capture path's bookkeeping, on any machine.

    A CUDA graph replays the kernels it recorded over the buffers it recorded
    them on. Capture needs CUDA, so here the recorder runs the step body once
    and hands the body back as its replay: run again, it reads the same
    static buffers and writes the same output buffer, as a replay would. So
    this checks what a graph relies on: each step copies its ids, slots and
    positions into its shape's buffers, every shape is recorded once (in the
    warm-up), all of a model's shapes write one output buffer sized for the
    largest, and the greedy tokens stay the eager ones. Unwarmed, a shape is
    recorded in the step that first takes it: its runs before the replay
    write the same KV that the replay then writes again. The cuda tests
    record real graphs.
    """
    eager, engine, tok = cpu_engines(EngineOptions(max_slots=4, max_length=128))
    assert engine.draft is not None
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    expected = [r.token_ids for r in generate(eager, prompts, GREEDY)]
    bodies: list[Callable[[], None]] = []

    def rerun(body: Callable[[], None]) -> Callable[[], None]:
        body()
        bodies.append(body)
        return body

    steps = []
    for runner in (engine.target, engine.draft):
        step = GraphStep(runner)
        step.recorder = rerun
        runner.graphs = step
        steps.append(step)
    if warm:
        assert engine.warm_up_graphs() == len(bodies) == 2 * graph_shapes(4)
    assert [r.token_ids for r in generate(engine, prompts, GREEDY)] == expected
    recorded = len(bodies)
    assert 0 < recorded <= 2 * graph_shapes(4)
    generate(engine, prompts[:3], SamplingParams(max_new_tokens=24, temperature=1.0, seed=3))
    if warm:
        assert len(bodies) == recorded  # nothing recorded after the warm-up
    for step in steps:
        shared = step._output
        assert shared is not None and shared.shape[0] == 4 * MAX_GRAPH_TOKENS_PER_ROW
        views = step._recorded.values()
        assert {view.logits.data_ptr() for view in views} == {shared.data_ptr()}


def test_the_captured_step_is_one_graph_that_writes_only_static_inputs() -> None:
    """What CUDA graph capture needs, checked by tracing on the CPU.

    ``fullgraph=True``: the step traces as one graph (a break would split the
    capture). And every input that the graph writes (the KV storage) must be
    a static input, or cudagraph trees skip capture ("mutated inputs"). The
    backend reads both from AOT autograd's metadata, where inductor reads them.
    """
    pair = build_pair("llama", seed=0)
    tok = pair.tokenizer
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    options = EngineOptions(max_slots=4, max_length=128)

    def engine(draft: bool) -> SpeculativeEngine:
        return SpeculativeEngine(  # plain linears, as on CUDA
            as_loaded(pair.target, tok, "t", cpu_kernels="default"),
            as_loaded(pair.draft, tok, "d", cpu_kernels="default") if draft else None,
            FIXED,
            options=options,
        )

    expected = [r.token_ids for r in generate(engine(draft=False), prompts, GREEDY)]
    graphs: list[tuple[list[int], list[int]]] = []  # (mutated inputs, static inputs)

    def inspect(gm: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        meta = TracingContext.get().fw_metadata
        assert meta is not None
        mutated = [i for i, info in enumerate(meta.input_info) if info.mutates_data]
        graphs.append((mutated, list(meta.static_input_indices)))
        return make_boxed_func(gm.forward)

    speculative = engine(draft=True)
    assert speculative.draft is not None
    for runner in (speculative.target, speculative.draft):
        step = GraphStep(runner, compile=True)
        step._compiled = torch.compile(  # type: ignore[assignment]
            step._forward,
            backend=aot_autograd(fw_compiler=inspect),
            fullgraph=True,
            dynamic=DYNAMIC_SHAPES,
        )
        runner.graphs = step
    assert [r.token_ids for r in generate(speculative, prompts, GREEDY)] == expected
    assert graphs
    for mutated, static in graphs:
        assert mutated  # the KV write
        assert set(mutated) <= set(static), f"mutated inputs {mutated} not static {static}"


@pytest.mark.parametrize("dynamic", [DYNAMIC_SHAPES, False], ids=["as-served", "static"])
def test_every_step_shape_stays_compiled(dynamic: bool | None) -> None:
    """No step shape falls back to eager.

    All GraphSteps share one code object, and past dynamo's default limit of
    8 compiled entries it would run new shapes eagerly, uncaptured. Here
    ``fullgraph=True`` turns that silent fallback into an error, over 3
    depths and 3 batch sizes (3 row buckets), with the engine's dynamic-shape
    setting and with fully static shapes (one compile per shape: more than 8).
    """
    pair = build_pair("llama", seed=0)
    tok = pair.tokenizer
    texts = [*TEXTS, "The refund will appear"]
    compiled: list[int] = []

    def count(gm: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        compiled.append(1)
        return gm.forward

    outputs: dict[int, list[list[int]]] = {}
    for depth in (1, 2, 4):
        knobs = SpeculationKnobs(max_depth=depth, min_depth=depth, adaptive=False)
        engine = SpeculativeEngine(
            as_loaded(pair.target, tok, "t", cpu_kernels="default"),
            as_loaded(pair.draft, tok, "d", cpu_kernels="default"),
            knobs,
            options=EngineOptions(max_slots=8, max_length=96),
        )
        assert engine.draft is not None
        for runner in (engine.target, engine.draft):
            step = GraphStep(runner, compile=True)
            step._compiled = torch.compile(  # type: ignore[assignment]
                step._forward, backend=count, fullgraph=True, dynamic=dynamic
            )
            runner.graphs = step
        for batch in (1, 2, 5):
            prompts = [tok(t)["input_ids"] for t in texts[:batch]]
            tokens = [r.token_ids for r in generate(engine, prompts, GREEDY)]
            assert tokens == outputs.setdefault(batch, tokens)  # the same at every depth
    assert len(compiled) > (8 if dynamic is False else 1)


def test_the_warm_up_compiles_every_shape_that_serving_then_takes() -> None:
    """After ``warm_up_graphs`` no request waits for a compile.

    Compiled for real by dynamo (a counting backend in place of inductor, which
    needs CUDA for graphs): the warm-up runs every (bucket, tokens per row)
    shape, and then batches of 1-6 requests, greedy and sampled, with adaptive
    depth and uniform prefill chunks, compile nothing new. The warm-up writes
    only the scratch slot, so the greedy tokens stay the eager ones.
    """
    texts = [*TEXTS, "The refund will appear", "a b c d e f g h"]
    knobs = SpeculationKnobs(max_depth=4, min_depth=1, adaptive=True)
    eager, engine, tok = cpu_engines(EngineOptions(max_slots=8, max_length=160), knobs)
    assert engine.draft is not None
    compiles: list[int] = []
    taken: set[tuple[int, int]] = set()

    def count(gm: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        compiles.append(1)
        return gm.forward

    for runner in (engine.target, engine.draft):
        step = GraphStep(runner, compile=True)
        compiled = torch.compile(step._forward, backend=count, dynamic=DYNAMIC_SHAPES)

        def recorded(*args: Any, _compiled: Any = compiled) -> torch.Tensor:
            taken.add((args[1].shape[0], args[3]))  # (rows after padding, tokens per row)
            return _compiled(*args)  # type: ignore[no-any-return]

        step._compiled = recorded  # type: ignore[assignment]
        runner.graphs = step
    readiness = Readiness()
    warm_up_graphs(readiness, engine)
    assert readiness.state.phase == "warming_up"
    assert taken == set(step_shapes(8)) and compiles
    warmed = len(compiles)
    taken.clear()
    for batch in (1, 2, 5, 6):
        prompts = [tok(t)["input_ids"] for t in texts[:batch]]
        expected = [r.token_ids for r in generate(eager, prompts, GREEDY)]
        assert [r.token_ids for r in generate(engine, prompts, GREEDY)] == expected
        generate(engine, prompts, SamplingParams(max_new_tokens=24, temperature=1.0, seed=batch))
    assert taken and len(compiles) == warmed, f"{len(compiles) - warmed} compiles after warm-up"


def test_a_server_without_graph_steps_skips_the_warm_up() -> None:
    pair = build_pair("llama", seed=0)
    target = as_loaded(pair.target, pair.tokenizer, "t")
    engine = SpeculativeEngine(target, None, FIXED, options=EngineOptions(max_slots=2))
    readiness = Readiness()
    warm_up_graphs(readiness, engine)  # on the CPU: nothing to capture
    assert engine.warm_up_graphs() == 0
    assert readiness.state.phase == "loading"


@pytest.mark.cuda
@pytest.mark.parametrize("compile", RECORDING)
def test_after_the_warm_up_cuda_steps_replay_without_recording(compile: bool) -> None:
    target, draft, prompts = tiny_pair_on_cuda()
    options = EngineOptions(max_slots=4, max_length=128, cuda_graph_compile=compile)
    engine = SpeculativeEngine(target, draft, FIXED, options=options)
    assert engine.draft is not None
    assert engine.warm_up_graphs() == 2 * graph_shapes(4)
    steps = [runner.graphs for runner in (engine.target, engine.draft)]
    assert all(step is not None and step.compiles == compile for step in steps)
    storage = [runner.allocate().tensor.data_ptr() for runner in (engine.target, engine.draft)]
    recorded = [step.recorded for step in steps if step is not None]
    assert recorded == ([0, 0] if compile else [graph_shapes(4)] * 2)
    counters.clear()
    assert all(r.token_ids for r in generate(engine, prompts, GREEDY))
    assert counters["stats"]["unique_graphs"] == 0  # nothing compiled after the warm-up
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert [step.recorded for step in steps if step is not None] == recorded  # none captured
    assert [r.allocate().tensor.data_ptr() for r in (engine.target, engine.draft)] == storage


def test_logprobs_read_from_a_replayed_steps_output_buffer() -> None:
    """A replay writes its logits into one buffer shared by all shapes; the step's
    logprobs are taken from it before the next step overwrites it."""
    eager, engine, tok = cpu_engines(EngineOptions(max_slots=4, max_length=128))
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    params = SamplingParams(max_new_tokens=24, logprobs=2)

    def logprobs_of(run_on: SpeculativeEngine) -> dict[str, list[tuple[int, float]]]:
        for i, prompt in enumerate(prompts):
            run_on.add_request(str(i), prompt, params)
        out: dict[str, list[tuple[int, float]]] = {str(i): [] for i in range(len(prompts))}
        while run_on.has_unfinished():
            for event in run_on.step():
                out[event.request_id] += [(e.token_id, e.logprob) for e in event.logprobs or []]
        return out

    expected = logprobs_of(eager)

    def rerun(body: Callable[[], None]) -> Callable[[], None]:
        body()
        return body

    for runner in (engine.target, engine.draft):
        assert runner is not None
        step = GraphStep(runner)
        step.recorder = rerun
        runner.graphs = step
    got = logprobs_of(engine)
    for request_id, entries in expected.items():
        assert [t for t, _ in got[request_id]] == [t for t, _ in entries]
        torch.testing.assert_close(
            torch.tensor([lp for _, lp in got[request_id]]),
            torch.tensor([lp for _, lp in entries]),
            atol=1e-4,
            rtol=1e-4,
        )
