"""The engine benchmark: modes interleaved prompt by prompt, engine modes in lockstep;
the report compares within rounds."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from bench.engine_harness import (
    TARGET_ONLY,
    BenchResult,
    BenchSettings,
    EngineMode,
    Lockstep,
    ModeResult,
    ModeRunner,
    format_table,
    run_interleaved,
)
from tools.tiny_models import as_loaded, build_pair

from specpair_runtime.config import SpeculationKnobs
from specpair_runtime.engine.api import SamplingParams, StepEvent
from specpair_runtime.engine.oneshot import run_request
from specpair_runtime.engine.options import EngineOptions
from specpair_runtime.engine.speculative import SpeculativeEngine

DEFAULT = "specpair default (adaptive<=4)"


def mode(name: str, depth: int | None, rates: list[float]) -> ModeResult:
    return ModeResult(name, depth, tokens=96, seconds=10.0, target_passes=32, run_rates=rates)


def result() -> BenchResult:
    # Round 2 ran in a slow spell of the machine: every mode is slower there.
    modes = [
        mode(TARGET_ONLY, None, [4.0, 2.0, 4.0]),
        mode("specpair k=2", 2, [7.0, 3.5, 7.2]),
        mode("specpair k=4", 4, [9.0, 4.4, 9.2]),
        mode(DEFAULT, 4, [9.9, 4.5, 8.8]),
    ]
    return BenchResult(BenchSettings(depths=[2, 4], runs=3), modes, {"device": "cpu"})


def test_the_best_fixed_depth_is_the_fixed_mode_with_the_most_tokens_per_second() -> None:
    report = result()
    assert report.best_fixed_depth() == "specpair k=4"
    empty = BenchResult(BenchSettings(), [mode(TARGET_ONLY, None, [4.0])], {})
    assert empty.best_fixed_depth() is None


def test_the_default_is_compared_with_the_best_fixed_depth_round_by_round() -> None:
    report = result().to_dict()
    assert report["best_fixed_depth"] == "specpair k=4"
    rows = {row["mode"]: row for row in report["modes"]}  # type: ignore[attr-defined]
    per_round = rows[DEFAULT]["vs_best_fixed_depth_per_round"]
    assert per_round == pytest.approx([9.9 / 9.0, 4.5 / 4.4, 8.8 / 9.2])
    assert rows[DEFAULT]["vs_best_fixed_depth"] == pytest.approx(4.5 / 4.4)
    assert rows["specpair k=4"]["vs_best_fixed_depth"] == pytest.approx(1.0)


def test_the_table_names_the_best_fixed_depth_and_shows_the_spread() -> None:
    table = format_table(result())
    assert "against specpair k=4" in table
    default_line = next(line for line in table.splitlines() if line.startswith(DEFAULT))
    assert "1.02x [0.96-1.10]" in default_line


def test_each_prompt_goes_through_every_mode_before_the_next_in_a_rotating_order() -> None:
    calls: list[tuple[str, int]] = []

    def runner(name: str) -> ModeRunner:
        def decode(prompt: list[int]) -> ModeResult:
            calls.append((name, prompt[0]))
            return ModeResult(name, None, tokens=2, seconds=0.5, target_passes=1, outputs=[prompt])

        return ModeRunner(ModeResult(name, None), decode)

    runners = [runner(name) for name in ("a", "b", "c")]
    run_interleaved(runners, [[10], [11], [12], [13]], shift=1)
    assert calls == [
        ("b", 10), ("c", 10), ("a", 10),
        ("c", 11), ("a", 11), ("b", 11),
        ("a", 12), ("b", 12), ("c", 12),
        ("b", 13), ("c", 13), ("a", 13),
    ]  # fmt: skip
    totals = runners[0].result
    assert (totals.tokens, totals.seconds, totals.target_passes) == (8, 2.0, 4)
    assert totals.outputs == [[10], [11], [12], [13]]  # each mode keeps the prompts' order
    assert totals.drafted == 0  # an engine mode's counts add up from zero


def _tiny_modes(steps: list[str]) -> tuple[list[EngineMode], Callable[[], list[EngineMode]]]:
    """Target-only, k=1 and k=3 engines over one tiny pair; each step is logged in ``steps``.

    Returns the logged modes and a factory of fresh twins (no logging) for reference runs.
    """
    pair = build_pair("llama", seed=0)
    target = as_loaded(pair.target, pair.tokenizer, "target")
    draft = as_loaded(pair.draft, pair.tokenizer, "draft")
    params = SamplingParams(max_new_tokens=9, ignore_eos=True)
    options = EngineOptions(max_slots=1, max_length=64)

    def fresh() -> list[EngineMode]:
        modes = [
            EngineMode(
                ModeResult(TARGET_ONLY, None),
                SpeculativeEngine(target, None, SpeculationKnobs(), options=options),
                params,
            )
        ]
        for depth in (1, 3):
            knobs = SpeculationKnobs(max_depth=depth, min_depth=depth, adaptive=False)
            engine = SpeculativeEngine(target, draft, knobs, options=options)
            modes.append(EngineMode(ModeResult(f"specpair k={depth}", depth), engine, params))
        return modes

    logged = fresh()
    for mode in logged:

        def step(
            original: Callable[[], list[StepEvent]] = mode.engine.step, name: str = mode.result.mode
        ) -> list[StepEvent]:
            steps.append(name)
            return original()

        mode.engine.step = step  # type: ignore[method-assign]
    return logged, fresh


def test_lockstep_runs_one_step_of_each_unfinished_engine_per_tick_in_a_rotating_order() -> None:
    steps: list[str] = []
    modes, fresh = _tiny_modes(steps)
    ticks = itertools.count()
    lockstep = Lockstep(modes, shift=1, clock=lambda: float(next(ticks)))
    prompts = [[5, 6, 7, 8], [5, 6, 9]]
    for prompt in prompts:
        lockstep.run(prompt)

    names = [mode.result.mode for mode in modes]
    # Target-only needs a step per token (9); each speculative engine needs fewer.
    taken = {name: steps.count(name) for name in names}
    assert taken[TARGET_ONLY] == 18 and taken["specpair k=3"] < taken["specpair k=1"] < 18
    # Nine tokens take every engine at least three steps (a prefill, then at most
    # four tokens a step), so the first three ticks step all three: the first starts
    # at the shift's engine, and each later tick one engine further on.
    a, b, c = names
    assert steps[:9] == [b, c, a, c, a, b, a, b, c]
    # Each mode's time is its own steps (the fake clock adds 1 per step, 1 per admission).
    for mode in modes:
        assert mode.result.seconds == pytest.approx(taken[mode.result.mode] + len(prompts))
    # Decoding in lockstep gives what each engine gives alone, in the prompts' order.
    for logged, alone in zip(modes, fresh(), strict=True):
        expected = [run_request(alone.engine, p, alone.params).token_ids for p in prompts]
        assert logged.result.outputs == expected
        assert logged.result.tokens == 18
    assert modes[2].result.drafted and modes[2].result.target_passes < 18
