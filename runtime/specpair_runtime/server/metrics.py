"""Prometheus metrics; every series carries ``pair`` and ``pair_version``.

A private registry per server keeps tests that start several servers in one
process independent of each other. Families that vLLM also exports keep a
name that maps one-to-one to vLLM's (the table in docs/operations.md), so
dashboards move across with a rename. No family publishes a ``_created``
series: nothing reads it, and it would double the series of every counter.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specpair_runtime.engine.api import FinishReason, StepEvent
from specpair_runtime.engine.budget import STEP_KINDS, StepTiming

# Process-wide in prometheus_client: the runtime's process exports only these metrics.
disable_created_metrics()  # type: ignore[no-untyped-call]

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
# Every error answer, by the OpenAI error `code` it carries (a fixed set: a
# bounded label). "invalid_request" stands for a 400 without a code.
ERROR_REASONS = (
    "invalid_request",
    "invalid_api_key",
    "priority_not_allowed",
    "model_not_found",
    "context_length_exceeded",
    "request_too_large",
    "request_timeout",
    "queue_full",
    "not_ready",
    "shutting_down",
    "engine_error",
    "internal_error",
)
# How a queued request ended: OpenAI's finish reasons, "abort" (the client left),
# "error" (the engine or the server failed it).
FINISH_REASONS: tuple[FinishReason, ...] = ("stop", "length", "content_filter", "abort", "error")
DEVICE_PLAN_MODES = ("Colocated", "TargetOnly", "DoesNotFit")
CONTENT_TYPE = CONTENT_TYPE_LATEST


class _Families:
    """Creates metric families in one registry, labelled by pair (and one more label)."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.registry = registry
        self.labels = labels

    def counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, PAIR_LABELS, registry=self.registry).labels(**self.labels)

    def counter_by(self, name: str, doc: str, label: str) -> Counter:
        return Counter(name, doc, (*PAIR_LABELS, label), registry=self.registry)

    def gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(name, doc, PAIR_LABELS, registry=self.registry).labels(**self.labels)

    def histogram(self, name: str, doc: str) -> Histogram:
        family = Histogram(name, doc, PAIR_LABELS, buckets=LATENCY_BUCKETS, registry=self.registry)
        return family.labels(**self.labels)


class ServerMetrics:
    def __init__(self, pair: str, pair_version: str) -> None:
        self.registry = CollectorRegistry()
        self._labels = {"pair": pair, "pair_version": pair_version}
        families = _Families(self.registry, self._labels)
        self._add_speculation(families)
        self._add_tokens(families)
        self._add_latencies(families)
        self._add_scheduler_state(families)
        self._add_host(families)
        self._add_request_outcomes(families)
        self._create_labelled_series()

    def _add_speculation(self, f: _Families) -> None:
        self.draft_tokens = f.counter("specpair_draft_tokens", "Draft tokens proposed.")
        self.accepted_tokens = f.counter(
            "specpair_accepted_tokens", "Draft tokens the target accepted."
        )
        self._per_position = f.counter_by(
            "specpair_accepted_tokens_per_position",
            "Accepted draft tokens by draft position (0 = first drafted token).",
            "position",
        )
        self.speculation_steps = f.counter(
            "specpair_speculation_steps", "Steps in which a request speculated."
        )
        self._fallbacks = f.counter_by(
            "specpair_fallback", "Times speculation was turned off, by reason.", "reason"
        )
        self.speculation_enabled = f.gauge(
            "specpair_speculation_enabled", "1 while the pair speculates."
        )

    def _add_tokens(self, f: _Families) -> None:
        self.generated_tokens = f.counter(
            "specpair_generated_tokens", "Verified output tokens committed to requests."
        )
        # Cached over prompt tokens is prefix reuse's hit ratio (docs/operations.md).
        self.prompt_tokens = f.counter(
            "specpair_prompt_tokens", "Prompt tokens of the requests the engine admitted."
        )
        self.prompt_tokens_cached = f.counter(
            "specpair_prompt_tokens_cached",
            "Prompt tokens whose KV was reused instead of computed (prefix reuse).",
        )
        # An inter-token latency tail made of these is the text, not the engine: a
        # held-back chunk reaches the client a step later (docs/operations.md).
        self.held_back_steps = f.counter(
            "specpair_held_back_steps",
            "Steps in which a request committed tokens but streamed no text (an "
            "incomplete UTF-8 character, a possible stop-string prefix, or a special "
            "token that decodes to nothing): its next chunk spans two steps or more.",
        )

    def _add_latencies(self, f: _Families) -> None:
        self.ttft = f.histogram(
            "specpair_time_to_first_token_seconds", "Arrival to the first streamed text."
        )
        self.itl = f.histogram(
            "specpair_inter_token_latency_seconds",
            "Gap between consecutive verified chunks of one request.",
        )
        self.request_latency = f.histogram(
            "specpair_request_latency_seconds", "Arrival to the last token."
        )
        self.queue_time = f.histogram(
            "specpair_request_queue_time_seconds",
            "Arrival to admission into the running batch (time in the waiting queue).",
        )
        # Whether prompts entering stretch the running streams' steps: "mixed"
        # against "decode" is what the step budget bounds (engine/budget.py).
        self._step_seconds = Histogram(
            "specpair_step_seconds",
            "Engine step time (draft + target; device time on CUDA) by what the step "
            "carried: decode (decoding streams only), mixed (decoding streams beside "
            "prompt chunks), prefill (prompt chunks only).",
            (*PAIR_LABELS, "kind"),
            buckets=LATENCY_BUCKETS,
            registry=f.registry,
        )

    def _add_scheduler_state(self, f: _Families) -> None:
        self.requests_running = f.gauge(
            "specpair_requests_running", "Requests in the running batch."
        )
        self.requests_waiting = f.gauge(
            "specpair_requests_waiting", "Requests in the waiting queue."
        )
        self.kv_slot_usage = f.gauge(
            "specpair_kv_slot_usage",
            "Fraction of the KV cache in use, 0 to 1: slots held by running requests over "
            "all slots (one slot per request, serving.maxBatchSize of them).",
        )
        self.step_token_budget = f.gauge(
            "specpair_step_token_budget",
            "Tokens one engine step may take over all requests (chunked prefill budget: "
            "serving.maxStepTokens, or as measured).",
        )

    def _add_host(self, f: _Families) -> None:
        self.cpu_threads = f.gauge(
            "specpair_cpu_threads",
            "Threads torch's CPU kernels run on (serving.cpuThreads, OMP_NUM_THREADS, or "
            "torch's default capped by the cgroup's CPU quota).",
        )
        # Speed depends on the CPU far more than on its core count: pods on nodes
        # of different CPUs are told apart by this series.
        self.cpu = Info(
            "specpair_cpu",
            "The CPU the runtime runs on: model name, the ISA level torch dispatches to, "
            "and whether oneDNN runs bf16 GEMMs natively (the int4 draft's many-row calls).",
            PAIR_LABELS,
            registry=f.registry,
        ).labels(**self._labels)
        # Set once at start-up on CUDA (engine/device_plan.py); absent on the CPU.
        self._device_plan = Gauge(
            "specpair_device_plan",
            "Start-up device-memory plan on CUDA: 1 for the mode in force "
            "(Colocated, TargetOnly: the draft did not fit, DoesNotFit).",
            (*PAIR_LABELS, "mode"),
            registry=f.registry,
        )

    def _add_request_outcomes(self, f: _Families) -> None:
        self._finished = f.counter_by(
            "specpair_requests_finished",
            "Requests that left the queue or the running batch, by how they ended: "
            "stop, length, content_filter, abort (the client left) or error.",
            "finish_reason",
        )
        self._errors = f.counter_by(
            "specpair_request_errors",
            "Requests answered with an error (or ended by one mid-stream), by error code.",
            "reason",
        )
        self._by_key = f.counter_by(
            "specpair_requests_by_key",
            "Authorized /v1 requests by API key name (names from the key file).",
            "key",
        )

    def _create_labelled_series(self) -> None:
        """Every series of a fixed label set exists from the start, at 0."""
        for reason in FALLBACK_REASONS:
            self._fallbacks.labels(**self._labels, reason=reason)
        for code in ERROR_REASONS:
            self._errors.labels(**self._labels, reason=code)
        for finish in FINISH_REASONS:
            self._finished.labels(**self._labels, finish_reason=finish)
        for kind in STEP_KINDS:
            self._step_seconds.labels(**self._labels, kind=kind)

    def device_plan(self, mode: str) -> None:
        for each in DEVICE_PLAN_MODES:
            self._device_plan.labels(**self._labels, mode=each).set(1 if each == mode else 0)

    def fallback(self, reason: str) -> None:
        self._fallbacks.labels(**self._labels, reason=reason).inc()

    def error(self, code: str | None) -> None:
        reason = code if code in ERROR_REASONS else "invalid_request"
        self._errors.labels(**self._labels, reason=reason).inc()

    def finished(self, reason: FinishReason) -> None:
        self._finished.labels(**self._labels, finish_reason=reason).inc()

    def step(self, timing: StepTiming) -> None:
        self._step_seconds.labels(**self._labels, kind=timing.kind).observe(timing.seconds)

    def request_by_key(self, name: str) -> None:
        self._by_key.labels(**self._labels, key=name).inc()

    def record_event(self, event: StepEvent) -> None:
        self.generated_tokens.inc(len(event.token_ids))
        self.prompt_tokens_cached.inc(event.cached_prompt_tokens)
        if event.token_ids and not event.text and not event.finished:
            self.held_back_steps.inc()
        if event.drafted <= 0:
            return
        self.speculation_steps.inc()
        self.draft_tokens.inc(event.drafted)
        self.accepted_tokens.inc(event.accepted)
        for position in range(event.accepted):
            self._per_position.labels(**self._labels, position=str(position)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
