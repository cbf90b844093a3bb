"""Prometheus metrics; every series carries ``pair`` and ``pair_version``.

A private registry per server keeps tests that start several servers in one
process independent of each other.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from specpair_runtime.engine.api import StepEvent
from specpair_runtime.engine.budget import STEP_KINDS, StepTiming

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
DEVICE_PLAN_MODES = ("Colocated", "TargetOnly", "DoesNotFit")
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
        # Cached over prompt tokens is prefix reuse's hit ratio (docs/operations.md).
        self.prompt_tokens = counter(
            "specpair_prompt_tokens", "Prompt tokens of the requests the engine admitted."
        ).labels(**labels)
        self.prompt_tokens_cached = counter(
            "specpair_prompt_tokens_cached",
            "Prompt tokens whose KV was reused instead of computed (prefix reuse).",
        ).labels(**labels)
        self.speculation_steps = counter(
            "specpair_speculation_steps", "Steps in which a request speculated."
        ).labels(**labels)
        # An inter-token latency tail made of these is the text, not the engine: a
        # held-back chunk reaches the client a step later (docs/operations.md).
        self.held_back_steps = counter(
            "specpair_held_back_steps",
            "Steps in which a request committed tokens but streamed no text (an "
            "incomplete UTF-8 character, a possible stop-string prefix, or a special "
            "token that decodes to nothing): its next chunk spans two steps or more.",
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
        # Whether prompts entering stretch the running streams' steps: "mixed"
        # against "decode" is what the step budget bounds (engine/budget.py).
        self._step_seconds = Histogram(
            "specpair_step_seconds",
            "Engine step time (draft + target; device time on CUDA) by what the step "
            "carried: decode (decoding streams only), mixed (decoding streams beside "
            "prompt chunks), prefill (prompt chunks only).",
            (*PAIR_LABELS, "kind"),
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.requests_running = Gauge(
            "specpair_requests_running", "Requests in the running batch.", PAIR_LABELS, registry=reg
        ).labels(**labels)
        self.requests_waiting = Gauge(
            "specpair_requests_waiting", "Requests in the waiting queue.", PAIR_LABELS, registry=reg
        ).labels(**labels)
        self.cpu_threads = Gauge(
            "specpair_cpu_threads",
            "Threads torch's CPU kernels run on (serving.cpuThreads, OMP_NUM_THREADS, or "
            "torch's default capped by the cgroup's CPU quota).",
            PAIR_LABELS,
            registry=reg,
        ).labels(**labels)
        # Speed depends on the CPU far more than on its core count (hardware.py):
        # pods on nodes of different CPUs are told apart by this series.
        self.cpu = Info(
            "specpair_cpu",
            "The CPU the runtime runs on: model name, the ISA level torch dispatches to, "
            "and whether oneDNN runs bf16 GEMMs natively (the int4 draft's many-row calls).",
            PAIR_LABELS,
            registry=reg,
        ).labels(**labels)
        self.step_token_budget = Gauge(
            "specpair_step_token_budget",
            "Tokens one engine step may take over all requests (chunked prefill budget: "
            "serving.maxStepTokens, or as measured).",
            PAIR_LABELS,
            registry=reg,
        ).labels(**labels)
        self._errors = Counter(
            "specpair_request_errors",
            "Requests answered with an error (or ended by one mid-stream), by error code.",
            (*PAIR_LABELS, "reason"),
            registry=reg,
        )
        self._by_key = Counter(
            "specpair_requests_by_key",
            "Authorized /v1 requests by API key name (names from the key file).",
            (*PAIR_LABELS, "key"),
            registry=reg,
        )
        # Set once at start-up on CUDA (engine/device_plan.py); absent on the CPU.
        self._device_plan = Gauge(
            "specpair_device_plan",
            "Start-up device-memory plan on CUDA: 1 for the mode in force "
            "(Colocated, TargetOnly: the draft did not fit, DoesNotFit).",
            (*PAIR_LABELS, "mode"),
            registry=reg,
        )
        self._labels = labels
        # Create the labelled children up front so every series exists at 0.
        for reason in FALLBACK_REASONS:
            self._fallbacks.labels(**labels, reason=reason)
        for reason in ERROR_REASONS:
            self._errors.labels(**labels, reason=reason)
        for kind in STEP_KINDS:
            self._step_seconds.labels(**labels, kind=kind)

    def device_plan(self, mode: str) -> None:
        for each in DEVICE_PLAN_MODES:
            self._device_plan.labels(**self._labels, mode=each).set(1 if each == mode else 0)

    def fallback(self, reason: str) -> None:
        self._fallbacks.labels(**self._labels, reason=reason).inc()

    def error(self, code: str | None) -> None:
        reason = code if code in ERROR_REASONS else "invalid_request"
        self._errors.labels(**self._labels, reason=reason).inc()

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
