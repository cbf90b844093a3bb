"""Acceptance aggregation and drift (operator/specpair_operator/acceptance.py)."""

from __future__ import annotations

import pytest

from specpair_operator.acceptance import (
    PodSample,
    drifted,
    keep_only,
    parse_metrics,
    settled,
    speculation_off,
    window,
)

METRICS = """\
# HELP specpair_draft_tokens_total Draft tokens proposed.
# TYPE specpair_draft_tokens_total counter
specpair_draft_tokens_total{pair="chat",pair_version="v1"} 120.0
specpair_draft_tokens_created{pair="chat",pair_version="v1"} 1.7e+09
specpair_accepted_tokens_total{pair="chat",pair_version="v1"} 90.0
specpair_accepted_tokens_per_position_total{pair="chat",pair_version="v1",position="0"} 30.0
specpair_speculation_steps_total{pair="chat",pair_version="v1"} 30.0
specpair_fallback_total{pair="chat",pair_version="v1",reason="memory_pressure"} 2.0
specpair_fallback_total{pair="chat",pair_version="v1",reason="batch_size"} 0.0
specpair_speculation_enabled{pair="chat",pair_version="v1"} 0.0
"""


def test_parse_metrics_reads_the_runtime_counters() -> None:
    sample = parse_metrics(METRICS)
    assert (sample.drafted, sample.accepted, sample.steps) == (120.0, 90.0, 30.0)
    assert not sample.speculating
    assert sample.fallbacks == {"memory_pressure": 2.0, "batch_size": 0.0}


VLLM_METRICS = """\
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="pair"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="pair"} 40.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="pair"} 25.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="pair",position="0"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="pair",position="1"} 7.0
vllm:generation_tokens_total{engine="0",model_name="pair"} 50.0
"""


def test_parse_metrics_reads_vllm_counters_into_the_same_fields() -> None:
    sample = parse_metrics(VLLM_METRICS)
    assert (sample.steps, sample.drafted, sample.accepted, sample.generated) == (10, 40, 25, 50)
    assert sample.per_position == {0: 9.0, 1: 7.0}
    win = window({}, {"pod": sample})
    assert win.speculated_share == (10 + 25) / 50
    assert win.position_rates == [0.9, 0.7]


def test_parse_metrics_of_a_fresh_runtime_is_zero_and_speculating() -> None:
    sample = parse_metrics("# nothing yet\n")
    assert (sample.drafted, sample.accepted, sample.steps, sample.speculating) == (0, 0, 0, True)


def test_window_sums_the_deltas_over_pods() -> None:
    anchors = {"a": PodSample(100, 80, 25), "b": PodSample(10, 5, 3)}
    samples = {"a": PodSample(200, 150, 50), "b": PodSample(30, 15, 8), "c": PodSample(20, 4, 5)}
    win = window(anchors, samples)
    # a: 100/70/25, b: 20/10/5, c (new, from 0): 20/4/5
    assert (win.drafted, win.accepted, win.steps) == (140, 84, 35)
    assert win.rate == pytest.approx(84 / 140)
    assert win.mean_accepted_length == pytest.approx(84 / 35)


def test_a_restarted_pod_counts_from_zero() -> None:
    win = window({"a": PodSample(500, 400, 100)}, {"a": PodSample(40, 10, 10)})
    assert (win.drafted, win.accepted, win.steps) == (40, 10, 10)


def test_an_empty_window_has_rate_zero_and_is_not_settled() -> None:
    win = window({}, {"a": PodSample()})
    assert win.rate == 0.0 and win.mean_accepted_length == 0.0
    assert not settled(win, 1)
    assert settled(window({}, {"a": PodSample(64, 10, 16)}), 64)
    assert not settled(window({}, {"a": PodSample(63, 10, 16)}), 64)


@pytest.mark.parametrize(
    ("rate", "baseline", "tolerance", "expected"),
    [
        (0.59, 0.8, 0.25, True),  # below 0.6
        (0.61, 0.8, 0.25, False),
        (0.4, 0.8, 0.5, False),  # at the threshold is not a drop below it
        (0.1, None, 0.25, False),  # no baseline yet
        (0.95, 0.8, 0.1, False),  # a rise is never drift
    ],
)
def test_drift_is_a_drop_below_baseline_times_one_minus_tolerance(
    rate: float, baseline: float | None, tolerance: float, expected: bool
) -> None:
    assert drifted(rate, baseline, tolerance) is expected


def test_speculation_off_names_the_pod_and_the_growing_fallback() -> None:
    anchors = {"a": PodSample(fallbacks={"memory_pressure": 5, "acceptance_floor": 1})}
    samples = {
        "a": PodSample(speculating=False, fallbacks={"memory_pressure": 5, "acceptance_floor": 3}),
        "b": PodSample(speculating=False),
        "c": PodSample(speculating=True, fallbacks={"batch_size": 9}),
    }
    assert speculation_off(samples, anchors) == [("a", "acceptance_floor"), ("b", "disabled")]


def test_keep_only_drops_the_anchors_of_pods_that_left() -> None:
    anchors = {"a": PodSample(1), "b": PodSample(2)}
    assert keep_only(anchors, ["b", "c"]) == {"b": PodSample(2)}


def test_parse_metrics_reads_what_the_runtime_server_exports() -> None:
    """The metric names are a contract with runtime/specpair_runtime/server/metrics.py."""
    from specpair_runtime.engine.api import StepEvent
    from specpair_runtime.server.metrics import ServerMetrics

    exported = ServerMetrics("chat", "v1")
    for accepted in (4, 1, 3):
        exported.record_event(StepEvent("r1", [1] * (accepted + 1), "x", 4, accepted))
    exported.fallback("memory_pressure")
    exported.speculation_enabled.set(0)
    sample = parse_metrics(exported.render().decode())
    assert (sample.drafted, sample.accepted, sample.steps) == (12.0, 8.0, 3.0)
    assert sample.generated == 11.0  # 8 accepted + 3 target tokens
    assert not sample.speculating
    assert speculation_off({"p": sample}, {}) == [("p", "memory_pressure")]


def test_speculated_share_counts_the_tokens_of_speculating_steps() -> None:
    # 10 speculating steps committed 10 + 30 tokens; 60 came from target-only steps.
    win = window({}, {"a": PodSample(drafted=40, accepted=30, steps=10, generated=100)})
    assert win.generated == 100 and win.speculated_share == pytest.approx(0.4)
    assert window({}, {"a": PodSample(4, 3, 1)}).speculated_share is None  # nothing generated
    # A row that stopped inside its accepted drafts committed fewer: never above 1.
    assert window({}, {"a": PodSample(8, 8, 2, generated=9)}).speculated_share == 1.0
