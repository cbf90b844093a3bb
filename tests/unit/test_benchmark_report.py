"""The engine benchmark: modes interleaved prompt by prompt; the report compares within rounds."""

from __future__ import annotations

import pytest

from specpair_runtime.benchmark import (
    TARGET_ONLY,
    BenchResult,
    BenchSettings,
    ModeResult,
    ModeRunner,
    format_table,
    run_interleaved,
)

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
