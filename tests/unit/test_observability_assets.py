"""Every metric the Grafana dashboard and the PrometheusRule name is one the
runtime exports, starting from the runtime's real metrics registry."""

from __future__ import annotations

import json
import re

import promql_parser
import pytest
from tools.control_plane import Binaries

from specpair_runtime.server.metrics import ServerMetrics
from tests.support.helm_chart import CHART, ROOT, find, render

# Grafana's template variables, replaced by values PromQL accepts before parsing.
GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "$namespace": ".*",
    "$pair_version": ".*",
    "$pair": ".*",
}
LABEL_VALUES = re.compile(r"^label_values\((.*),\s*\w+\)$")
# The series names prometheus_client writes for one family of each type (no
# `_created` series: the runtime turns them off).
SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
    "gauge": ("",),
    "info": ("_info",),
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
    "requests by finish_reason": "specpair_requests_finished_total",
    "queue time": "specpair_request_queue_time_seconds_bucket",
    "KV slot usage": "specpair_kv_slot_usage",
}


def exported_series() -> set[str]:
    """Series names of the runtime's registry, histograms and counters expanded."""
    names: set[str] = set()
    for family in ServerMetrics("pair", "v1").registry.collect():
        names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return names


def dashboard_queries() -> list[str]:
    """The PromQL of every panel target and every query variable of the dashboard."""
    dashboard = json.loads((CHART / "dashboards" / "specpair.json").read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            queries.append(query["query"] if isinstance(query, dict) else query)
    return queries


def rule_queries(binaries: Binaries) -> list[str]:
    objects = render(binaries, {"metrics.prometheusRule.enabled": "true"})
    (rule,) = find(objects, "PrometheusRule")
    return [r["expr"] for group in rule["spec"]["groups"] for r in group["rules"]]


def parse_promql(query: str) -> promql_parser.Expr:
    """The query's AST; Grafana's `label_values(selector, label)` yields its selector."""
    text = query.strip()
    # Longest first: $pair_version before $pair.
    for variable in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        text = text.replace(variable, GRAFANA_VARIABLES[variable])
    match = LABEL_VALUES.match(text)
    if match:
        text = match.group(1)
    try:
        return promql_parser.parse(text)
    except ValueError as error:
        raise AssertionError(f"not valid PromQL ({error}): {query}") from None


def metrics_in(queries: list[str]) -> set[str]:
    """Every metric name the queries select, from their parsed PromQL."""
    names: set[str] = set()

    def visit(node: object) -> bool:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(str(node.name))
        return True

    for query in queries:
        promql_parser.walk(parse_promql(query), visit)
    return names


def test_expansion_covers_histograms_and_counters() -> None:
    exported = exported_series()
    assert "specpair_inter_token_latency_seconds_bucket" in exported
    assert "specpair_draft_tokens_total" in exported
    assert "specpair_draft_tokens" not in exported  # a counter's bare name is no series
    assert "specpair_speculation_enabled" in exported
    assert "specpair_draft_tokens_created" not in exported


def test_no_created_series_are_rendered() -> None:
    metrics = ServerMetrics("p", "v")
    metrics.fallback("batch_size")
    metrics.ttft.observe(0.1)
    metrics.finished("stop")
    text = metrics.render().decode()
    assert "specpair_fallback_total" in text and "specpair_requests_finished_total" in text
    assert "_created" not in text


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


def test_broken_promql_is_caught() -> None:
    with pytest.raises(AssertionError, match="not valid PromQL"):
        metrics_in(["sum by (pair (rate(specpair_fallback_total[5m]))"])


def test_dashboard_labels_exist_on_the_series() -> None:
    """The dashboard groups by pair, pair_version, reason, position and kind: real labels."""
    metrics = ServerMetrics("p", "v")
    metrics.fallback("batch_size")
    text = metrics.render().decode()
    assert 'specpair_fallback_total{pair="p",pair_version="v",reason="batch_size"} 1.0' in text
    assert 'specpair_step_seconds_count{kind="mixed",pair="p",pair_version="v"} 0.0' in text
    for query in dashboard_queries():
        for group in re.findall(r"by \(([^)]*)\)", query):
            labels = {label.strip() for label in group.split(",")}
            # namespace comes from Prometheus' service discovery, le from histograms.
            allowed = {"namespace", "pair", "pair_version", "reason", "position", "kind", "le"}
            allowed.add("finish_reason")
            assert labels <= allowed, query


def vllm_mapping() -> dict[str, str]:
    """docs/operations.md's table: specpair series name -> vLLM's, label sets dropped."""
    text = (ROOT / "docs" / "operations.md").read_text()
    rows = re.findall(r"^\| `(specpair_[^`{]+)[^`]*` \| \w+ \| `(vllm:[^`{]+)[^`]*` \|", text, re.M)
    return dict(rows)


def test_the_vllm_mapping_is_one_to_one_over_exported_series() -> None:
    mapping = vllm_mapping()
    assert len(mapping) >= 15, mapping
    assert len(set(mapping.values())) == len(mapping), "two specpair families map to one vLLM one"
    exported = exported_series()
    unknown = {name for name in mapping if not {name, f"{name}_bucket"} & exported}
    assert not unknown, f"the table names series the runtime does not export: {unknown}"
    # The families the issue names are in the table.
    for name in ("requests_finished_total", "request_queue_time_seconds", "kv_slot_usage"):
        assert f"specpair_{name}" in mapping
