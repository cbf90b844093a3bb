"""Prometheus metrics; every series carries ``pair`` and ``pair_version``.

A private registry per server keeps tests that start several servers in one
process independent of each other.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specpair_runtime.engine.api import StepEvent

PAIR_LABELS = ("pair", "pair_version")
# Sub-millisecond steps on tiny models up to slow CPU steps on real ones.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
FALLBACK_REASONS = ("memory_pressure", "batch_size", "acceptance_floor", "disabled")
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self, pair: str, pair_version: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"pair": pair, "pair_version": pair_version}
        reg = self.registry

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, PAIR_LABELS, registry=reg)

        self.draft_tokens = counter("specpair_draft_tokens", "Draft tokens proposed.").labels(
            **labels
        )
        self.accepted_tokens = counter(
            "specpair_accepted_tokens", "Draft tokens the target accepted."
        ).labels(**labels)
        self._per_position = Counter(
            "specpair_accepted_tokens_per_position",
            "Accepted draft tokens by draft position (0 = first drafted token).",
            (*PAIR_LABELS, "position"),
            registry=reg,
        )
        self.generated_tokens = counter(
            "specpair_generated_tokens", "Verified output tokens committed to requests."
        ).labels(**labels)
        self.speculation_steps = counter(
            "specpair_speculation_steps", "Steps in which a request speculated."
        ).labels(**labels)
        self._fallbacks = Counter(
            "specpair_fallback",
            "Times speculation was turned off, by reason.",
            (*PAIR_LABELS, "reason"),
            registry=reg,
        )
        self.speculation_enabled = Gauge(
            "specpair_speculation_enabled",
            "1 while the pair speculates.",
            PAIR_LABELS,
            registry=reg,
        ).labels(**labels)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, PAIR_LABELS, buckets=LATENCY_BUCKETS, registry=reg)

        self.ttft = histogram(
            "specpair_time_to_first_token_seconds", "Arrival to the first streamed text."
        ).labels(**labels)
        self.itl = histogram(
            "specpair_inter_token_latency_seconds",
            "Gap between consecutive verified chunks of one request.",
        ).labels(**labels)
        self.request_latency = histogram(
            "specpair_request_latency_seconds", "Arrival to the last token."
        ).labels(**labels)
        self.requests_running = Gauge(
            "specpair_requests_running", "Requests in the running batch.", PAIR_LABELS, registry=reg
        ).labels(**labels)
        self.requests_waiting = Gauge(
            "specpair_requests_waiting", "Requests in the waiting queue.", PAIR_LABELS, registry=reg
        ).labels(**labels)
        self._labels = labels
        # Create the labelled children up front so every series exists at 0.
        for reason in FALLBACK_REASONS:
            self._fallbacks.labels(**labels, reason=reason)

    def fallback(self, reason: str) -> None:
        self._fallbacks.labels(**self._labels, reason=reason).inc()

    def record_event(self, event: StepEvent) -> None:
        self.generated_tokens.inc(len(event.token_ids))
        if event.drafted <= 0:
            return
        self.speculation_steps.inc()
        self.draft_tokens.inc(event.drafted)
        self.accepted_tokens.inc(event.accepted)
        for position in range(event.accepted):
            self._per_position.labels(**self._labels, position=str(position)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
