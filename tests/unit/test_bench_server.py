"""bench_server's reading of the server's step histogram, from a real ServerMetrics page."""

from __future__ import annotations

import pytest
from bench.bench_server import describe_steps, step_delta, step_totals

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
