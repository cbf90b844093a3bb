"""Counting the apiserver's requests from its own /metrics text."""

from __future__ import annotations

from collections import Counter

from tools.apiserver_metrics import delta, parse_request_totals


def sample(code: str, resource: str, subresource: str, verb: str, value: int) -> str:
    labels = (
        f'code="{code}",component="apiserver",contentType="application/json",dry_run="",'
        f'resource="{resource}",scope="resource",subresource="{subresource}",verb="{verb}"'
    )
    return f"apiserver_request_total{{{labels}}} {value}"


TEXT = "\n".join(
    [
        "# TYPE apiserver_request_total counter",
        sample("200", "deployments", "", "GET", 12),
        sample("404", "deployments", "", "GET", 3),
        sample("200", "speculativepairs", "status", "PATCH", 5),
        'apiserver_request_duration_seconds_count{verb="GET"} 99',
    ]
)


def test_totals_are_summed_over_codes_by_verb_resource_and_subresource() -> None:
    totals = parse_request_totals(TEXT)
    assert totals == Counter(
        {("GET", "deployments", ""): 15, ("PATCH", "speculativepairs", "status"): 5}
    )


def test_delta_keeps_what_grew() -> None:
    before = Counter({("GET", "pods", ""): 4, ("LIST", "nodes", ""): 2})
    after = Counter({("GET", "pods", ""): 9, ("LIST", "nodes", ""): 2, ("PUT", "leases", ""): 1})
    assert delta(after, before) == Counter({("GET", "pods", ""): 5, ("PUT", "leases", ""): 1})
