"""The operator's own Prometheus metrics (the runtime exports the serving ones)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram, start_http_server

RECONCILES = Counter(
    "specpair_operator_reconciles_total",
    "Reconcile passes over SpeculativePair objects, by trigger and result.",
    ["trigger", "result"],
)
ERRORS = Counter(
    "specpair_operator_errors_total",
    "Reconcile errors, by kind (api status code or exception type).",
    ["kind"],
)
WRITES = Counter(
    "specpair_operator_writes_total",
    "Writes to the API server, by kind of object and verb.",
    ["kind", "verb"],
)
API_REQUESTS = Counter(
    "specpair_operator_api_requests_total",
    "Requests the operator sent to the API server (kopf's watch streams aside), by verb and "
    "resource.",
    ["verb", "resource"],
)
LATENCY = Histogram(
    "specpair_operator_reconcile_duration_seconds",
    "Wall time of one reconcile pass.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)


def serve(port: int, address: str) -> None:
    """Expose /metrics on ``address:port`` (a daemon thread)."""
    start_http_server(port, addr=address)
