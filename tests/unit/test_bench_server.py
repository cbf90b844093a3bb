"""bench_server's reading of the server's step histogram and held-back steps, from a real
ServerMetrics page."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from bench.bench_server import (
    LevelResult,
    StreamResult,
    describe_held_back,
    describe_round,
    describe_steps,
    describe_ttft,
    goal_ratios,
    held_back_steps,
    is_long,
    merge_rounds,
    prompt_for,
    round_order,
    server_env,
    step_delta,
    step_totals,
)

from specpair_runtime.engine.api import StepEvent
from specpair_runtime.engine.budget import StepTiming
from specpair_runtime.server.metrics import ServerMetrics


def test_step_counts_and_means_per_kind_between_two_scrapes() -> None:
    metrics = ServerMetrics("pair", "v1")
    metrics.step(StepTiming("prefill", 2.0))  # before the level: not counted
    before = step_totals(metrics.render().decode())
    assert before == {"decode": (0.0, 0.0), "mixed": (0.0, 0.0), "prefill": (1.0, 2.0)}
    for seconds in (0.1, 0.3):
        metrics.step(StepTiming("decode", seconds))
    metrics.step(StepTiming("mixed", 0.25))
    steps = step_delta(before, step_totals(metrics.render().decode()))
    assert steps.keys() == {"decode", "mixed"}  # no prefill step ran in the level
    assert steps["decode"]["count"] == 2
    assert steps["decode"]["mean_ms"] == pytest.approx(200.0)
    assert steps["mixed"] == {"count": 1, "mean_ms": 250.0}
    assert describe_steps(steps) == "decode 2 x 200.0 ms, mixed 1 x 250.0 ms (1.25x decode)"


def test_a_server_without_the_histogram_reports_no_steps() -> None:
    assert step_totals("# an older runtime\nspecpair_requests_running 0\n") == {}
    assert describe_steps(step_delta({}, {})) == "none reported"


def test_held_back_steps_count_the_steps_that_streamed_no_text() -> None:
    """A step that commits a token but releases no text (say, an incomplete UTF-8
    character) is counted; a step with text, or the one that finishes, is not."""
    metrics = ServerMetrics("pair", "v1")
    assert held_back_steps(metrics.render().decode()) == 0
    metrics.record_event(StepEvent("r1", [7], "", 1, 0))  # held back
    metrics.record_event(StepEvent("r1", [8, 9], "é!", 1, 1))  # releases it
    metrics.record_event(StepEvent("r2", [5], "", 0, 0, finished=True, finish_reason="stop"))
    metrics.record_event(StepEvent("r3", [], "", 0, 0))  # nothing committed
    assert held_back_steps(metrics.render().decode()) == 1
    assert held_back_steps("# an older runtime\nspecpair_requests_running 0\n") == 0


def test_the_held_back_share_is_of_the_levels_gaps() -> None:
    level = LevelResult("speculation", 8, 10.0, held_back_steps=3)
    level.results.append(StreamResult(ttft=0.1, gaps=[0.5] * 200, chunks=201, tokens=300))
    level.results.append(StreamResult(ttft=0.1, gaps=[0.5] * 100, chunks=101, tokens=150))
    summary = level.summary()
    assert (summary["gaps"], summary["held_back_share"]) == (300, 0.01)
    # The inclusive p99 of 300 gaps is the 3.99th largest: 3 held-back gaps lie above it.
    assert describe_held_back(level) == (
        "3 steps, 1.00 % of 300 gaps; the p99 is the 4.0th largest gap "
        "(the held-back gaps lie above the p99)"
    )
    level.held_back_steps = 4
    assert "the p99 is likely a held-back gap" in describe_held_back(level)


def test_every_other_prompt_of_a_stream_is_long_and_its_ttft_is_reported_apart() -> None:
    assert [is_long(0, r, 100) for r in range(4)] == [False, True, False, True]
    assert [is_long(1, r, 100) for r in range(2)] == [True, False]
    assert not any(is_long(i, r, 0) for i in range(3) for r in range(3))
    level = LevelResult("speculation", 2, 10.0)
    level.results.append(StreamResult(ttft=0.5, gaps=[], chunks=1, tokens=1))
    level.results.append(StreamResult(ttft=9.0, gaps=[], chunks=1, tokens=1, long_prompt=True))
    summary = level.summary()
    assert (summary["ttft_short_ms"]["p50"], summary["ttft_long_ms"]["p50"]) == (500.0, 9000.0)
    assert describe_ttft(level) == (
        "short prompts p50 500.0 / p95 500.0 ms (1), long prompts p50 9000.0 / p95 9000.0 ms (1)"
    )


def test_long_prompts_share_only_their_first_tokens() -> None:
    """Prefix reuse must not skip the context: each long prompt has its own case number."""
    first, second = (prompt_for(1, 0, 100, case) for case in (7, 8))
    assert first.startswith("Case 7. ") and second.startswith("Case 8. ")
    assert first[len("Case 7. ") :] == second[len("Case 8. ") :]
    assert prompt_for(0, 0, 100, 7) == prompt_for(0, 0, 100, 8)  # short prompts stay as they are


def test_rounds_alternate_the_order_of_the_levels() -> None:
    assert [round_order([8, 1], r) for r in range(3)] == [[1, 8], [8, 1], [1, 8]]


def test_a_levels_rounds_pool_their_gaps_steps_and_held_back_steps() -> None:
    first = LevelResult("speculation", 8, 10.0, held_back_steps=1)
    first.results.append(StreamResult(ttft=0.1, gaps=[0.2] * 99, chunks=100, tokens=150))
    first.steps = {"decode": {"count": 10, "mean_ms": 200.0}}
    second = LevelResult("speculation", 8, 30.0, held_back_steps=2)
    second.results.append(StreamResult(ttft=0.3, gaps=[0.6] * 99, chunks=100, tokens=150))
    second.steps = {
        "decode": {"count": 30, "mean_ms": 300.0},
        "mixed": {"count": 5, "mean_ms": 400.0},
    }
    merged = merge_rounds([first, second])
    summary = merged.summary()
    assert (summary["requests"], summary["gaps"], summary["tokens"]) == (2, 198, 300)
    assert summary["tokens_per_s"] == 7.5  # 300 tokens over both rounds' 40 s
    assert summary["held_back_steps"] == 3
    assert merged.steps == {
        "decode": {"count": 40, "mean_ms": 275.0},
        "mixed": {"count": 5, "mean_ms": 400.0},
    }
    # The slow round's gaps set the pooled p99, not the mean of two p99s.
    assert summary["itl_ms"]["p99"] == pytest.approx(600.0)
    with pytest.raises(ValueError, match="one mode and level"):
        merge_rounds([first, LevelResult("speculation", 1, 1.0)])


def test_the_goal_ratio_is_the_top_levels_p99_over_one_streams() -> None:
    single = LevelResult("speculation", 1, 1.0)
    single.results.append(StreamResult(ttft=0.1, gaps=[0.4] * 10, chunks=11, tokens=11))
    top = LevelResult("speculation", 8, 1.0)
    top.results.append(StreamResult(ttft=0.1, gaps=[0.5] * 10, chunks=11, tokens=11))
    assert goal_ratios([top, single]) == {"speculation": 1.25}
    assert describe_round([top, single], "speculation") == "1.25x (500 / 400 ms)"
    assert describe_round([top, single], "target-only") == "-"


def test_another_runtime_tree_is_what_the_server_child_imports(tmp_path: Path) -> None:
    env = server_env({"PATH": "/bin", "PYTHONPATH": "/elsewhere"}, tmp_path)
    assert env["PYTHONPATH"] == str(tmp_path / "runtime")
    assert env["HF_HUB_OFFLINE"] == "1" and env["PATH"] == "/bin"
    assert server_env({"PYTHONPATH": "/kept"}, None)["PYTHONPATH"] == "/kept"


def test_a_runtime_tree_without_the_package_is_refused_by_name(tmp_path: Path) -> None:
    bench = Path(__file__).resolve().parents[2] / "bench" / "bench_server.py"
    run = subprocess.run(
        [sys.executable, str(bench), "--tiny", "--runtime-src", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert f"--runtime-src: {tmp_path}/runtime/specpair_runtime does not exist" in run.stderr
