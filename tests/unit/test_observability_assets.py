"""Every metric the Grafana dashboard and the PrometheusRule name is one the
runtime exports, starting from the runtime's real metrics registry."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from specpair_runtime.server.metrics import ServerMetrics
from tests.support.control_plane import Binaries
from tests.support.helm_chart import CHART, find, render

METRIC = re.compile(r"\b(specpair_[a-z0-9_]+)\b")
# The series names prometheus_client writes for one family of each type.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
}
# The panels the issue asks for, by a metric each must use.
REQUIRED = {
    "acceptance rate": "specpair_accepted_tokens_total",
    "accepted tokens per position": "specpair_accepted_tokens_per_position_total",
    "tokens/s": "specpair_speculation_steps_total",
    "TTFT": "specpair_time_to_first_token_seconds_bucket",
    "ITL": "specpair_inter_token_latency_seconds_bucket",
    "fallbacks by reason": "specpair_fallback_total",
    "speculation on/off": "specpair_speculation_enabled",
}


def exported_series() -> set[str]:
    """Series names of the runtime's registry, histograms and counters expanded."""
    names: set[str] = set()
    for family in ServerMetrics("pair", "v1").registry.collect():
        names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return names


def _strings(node: Any, keys: tuple[str, ...]) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in keys and isinstance(value, str):
                yield value
            yield from _strings(value, keys)
    elif isinstance(node, list):
        for item in node:
            yield from _strings(item, keys)


def dashboard_queries() -> list[str]:
    dashboard = json.loads((CHART / "dashboards" / "specpair.json").read_text())
    return list(_strings(dashboard, ("expr", "query", "definition")))


def rule_queries(binaries: Binaries) -> list[str]:
    objects = render(binaries, {"metrics.prometheusRule.enabled": "true"})
    (rule,) = find(objects, "PrometheusRule")
    return [r["expr"] for group in rule["spec"]["groups"] for r in group["rules"]]


def metrics_in(queries: list[str]) -> set[str]:
    return {name for query in queries for name in METRIC.findall(query)}


def test_expansion_covers_histograms_and_counters() -> None:
    exported = exported_series()
    assert "specpair_inter_token_latency_seconds_bucket" in exported
    assert "specpair_draft_tokens_total" in exported
    assert "specpair_draft_tokens" not in exported  # a counter's bare name is no series
    assert "specpair_speculation_enabled" in exported


def test_dashboard_names_only_exported_metrics() -> None:
    used = metrics_in(dashboard_queries())
    assert used, "the dashboard names no specpair metric"
    unknown = used - exported_series()
    assert not unknown, f"the dashboard names metrics the runtime does not export: {unknown}"
    missing = {panel: m for panel, m in REQUIRED.items() if m not in used}
    assert not missing, f"dashboard panels missing: {missing}"


def test_alert_rules_name_only_exported_metrics(control_plane_binaries: Binaries) -> None:
    used = metrics_in(rule_queries(control_plane_binaries))
    assert {
        "specpair_accepted_tokens_total",
        "specpair_draft_tokens_total",
        "specpair_fallback_total",
        "specpair_inter_token_latency_seconds_bucket",
    } <= used
    unknown = used - exported_series()
    assert not unknown, f"the alerts name metrics the runtime does not export: {unknown}"


@pytest.mark.parametrize("name", ["specpair_accepted_tokens", "specpair_itl_seconds_bucket"])
def test_a_wrong_name_is_caught(name: str) -> None:
    assert metrics_in([f"rate({name}[5m])"]) - exported_series() == {name}


def test_dashboard_labels_exist_on_the_series() -> None:
    """The dashboard groups by pair, pair_version, reason and position: real labels."""
    metrics = ServerMetrics("p", "v")
    metrics.fallback("batch_size")
    text = metrics.render().decode()
    assert 'specpair_fallback_total{pair="p",pair_version="v",reason="batch_size"} 1.0' in text
    for query in dashboard_queries():
        for group in re.findall(r"by \(([^)]*)\)", query):
            labels = {label.strip() for label in group.split(",")}
            # namespace comes from Prometheus' service discovery, le from histograms.
            assert labels <= {"namespace", "pair", "pair_version", "reason", "position", "le"}, (
                query
            )
