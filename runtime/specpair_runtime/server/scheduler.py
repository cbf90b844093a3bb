"""Continuous batching: one engine thread steps every running request.

All engine calls happen on the engine thread; HTTP handlers talk to it only
through ``submit`` / ``abort`` / ``update_knobs`` (thread-safe) and receive
``Update`` objects through the sink they passed in. Requests join and leave
the running batch between steps. Between steps the thread also decides the
speculation pause: memory pressure (with hysteresis) first, then batch size.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

from specpair_runtime.config import SpeculationKnobs
from specpair_runtime.engine.api import Engine, FinishReason, SamplingParams, StepEvent
from specpair_runtime.engine.budget import StepTiming
from specpair_runtime.server.memory import MemoryProbe, PressureGate
from specpair_runtime.server.metrics import ServerMetrics
from specpair_runtime.server.queueing import QueueFull, RequestQueue

log = logging.getLogger("specpair.scheduler")

__all__ = ["ErrorCode", "QueueFull", "Scheduler", "Submission", "Update"]


# Why a request failed; the HTTP side maps each code to a fixed public message.
ErrorCode = Literal["engine_error", "invalid_request", "shutting_down"]


@dataclass(frozen=True)
class Update:
    """What a request's handler receives from the engine thread."""

    event: StepEvent | None = None
    error: str | None = None  # the request failed: the detail, for logs only
    error_code: ErrorCode = "engine_error"

    @property
    def finished(self) -> bool:
        return self.error is not None or (self.event is not None and self.event.finished)


@dataclass
class Submission:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[Update], None]  # called on the engine thread; must not block
    priority: int = 0
    arrival: float = field(default_factory=time.monotonic)
    first_text_at: float | None = None
    last_text_at: float | None = None


def _aborted(request_id: str, reason: FinishReason = "abort") -> StepEvent:
    return StepEvent(request_id, [], "", 0, 0, finished=True, finish_reason=reason)


def pause_reason(memory_pressure: bool, batch_size: int, knobs: SpeculationKnobs) -> str | None:
    """The one pause the engine should hold now; memory pressure wins."""
    if memory_pressure:
        return "memory_pressure"
    limit = knobs.disable_above_batch_size
    if limit is not None and batch_size > limit:
        return "batch_size"
    return None


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        knobs: SpeculationKnobs,
        metrics: ServerMetrics,
        probe: MemoryProbe,
        max_batch_size: int,
        max_waiting: int,
    ) -> None:
        self.engine = engine
        self.knobs = knobs
        self.metrics = metrics
        self.probe = probe
        self.max_batch_size = max_batch_size
        self.gate = PressureGate(knobs.memory_pressure_threshold)
        self.max_waiting = max_waiting
        # The queue also holds requests that the next step admits to free slots.
        self._queue: RequestQueue[Submission] = RequestQueue(max_waiting + max_batch_size)
        self._running: dict[str, Submission] = {}
        self._aborts: list[tuple[str, FinishReason]] = []
        self._new_knobs: SpeculationKnobs | None = None
        self._cond = threading.Condition()
        self._stopping = False
        self._pause: str | None = None
        self._speculating: bool | None = None
        self._thread: threading.Thread | None = None

    # -- thread-safe API for the HTTP side ---------------------------------

    def check_room(self) -> None:
        """Raise QueueFull now if a request would be refused: before any tokenizing."""
        with self._cond:
            self._check_room()

    def _check_room(self) -> None:
        # Requests that free slots will take at the next step are not waiting.
        free_slots = max(0, self.max_batch_size - len(self._running))
        if len(self._queue) >= self.max_waiting + free_slots:
            raise QueueFull(f"the waiting queue is full ({self.max_waiting} requests)")

    def submit(self, submission: Submission) -> None:
        """Queue a request; raises QueueFull when the waiting queue is full."""
        with self._cond:
            self._check_room()
            self._queue.push(submission.request_id, submission, submission.priority)
            self.metrics.requests_waiting.set(len(self._queue))
            self._cond.notify()

    def abort(self, request_id: str, reason: FinishReason = "abort") -> None:
        """Cancel a queued or running request; its slot frees before the next step.

        ``reason``: how the request ended, for the metrics ("content_filter" when
        the output filter stopped it).
        """
        with self._cond:
            queued = self._queue.remove(request_id)
            if queued is None:
                self._aborts.append((request_id, reason))
                self._cond.notify()
                return
            self.metrics.requests_waiting.set(len(self._queue))
            self.metrics.finished(reason)
        queued.sink(Update(event=_aborted(request_id, reason)))

    def update_knobs(self, knobs: SpeculationKnobs) -> None:
        with self._cond:
            self._new_knobs = knobs
            self._cond.notify()

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # -- the engine thread ---------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stopping or self._queue or self._running or self._aborts):
                    if self._new_knobs is not None:
                        break
                    self._cond.wait()
                if self._stopping:
                    break
                aborts, self._aborts = self._aborts, []
                knobs, self._new_knobs = self._new_knobs, None
                admitted: list[Submission] = []
                while self._queue and len(self._running) + len(admitted) < self.max_batch_size:
                    admitted.append(self._queue.pop())
                self.metrics.requests_waiting.set(len(self._queue))
            try:
                self._between_steps(aborts, knobs, admitted)
                if self._running:
                    self._step()
                    # Finished requests shrink the batch: lift a batch-size pause now.
                    self._update_pause()
            except Exception as error:
                # Which row broke is unknown: every running request fails.
                log.exception("engine step failed; failing the %d running requests", self.running)
                self._fail_running(f"engine step failed: {error!r}", "engine_error")
        with self._cond:
            queued = self._queue.drain()
        for submission in queued:
            self._fail(submission, "server is shutting down", "shutting_down")
        self._fail_running("server is shutting down", "shutting_down")

    def _between_steps(
        self,
        aborts: list[tuple[str, FinishReason]],
        knobs: SpeculationKnobs | None,
        admitted: list[Submission],
    ) -> None:
        for request_id, reason in aborts:
            submission = self._running.pop(request_id, None)
            if submission is not None:
                self.engine.abort(request_id)
                self.metrics.finished(reason)
                submission.sink(Update(event=_aborted(request_id, reason)))
        if knobs is not None:
            self.engine.update_knobs(knobs)
            self.knobs = knobs
            self.gate.threshold = knobs.memory_pressure_threshold
        for submission in admitted:
            try:
                self.engine.add_request(
                    submission.request_id, submission.prompt_ids, submission.params
                )
            except ValueError as error:  # this request is bad, the batch is fine
                log.warning("request %s rejected by the engine: %s", submission.request_id, error)
                self._fail(submission, f"rejected by the engine: {error}", "invalid_request")
                continue
            self._running[submission.request_id] = submission
            self.metrics.prompt_tokens.inc(len(submission.prompt_ids))
            self.metrics.queue_time.observe(time.monotonic() - submission.arrival)
        self.metrics.requests_running.set(len(self._running))
        self._update_kv_slot_usage()
        self._update_pause()

    def _update_pause(self) -> None:
        changed = self.gate.update(self.probe.reading())
        if changed is True:
            log.warning(
                "memory pressure above %.2f: speculation paused, draft KV cache freed",
                self.gate.threshold,
            )
        elif changed is False:
            log.info("memory pressure below %.2f: speculation resumes", self.gate.release_below)
        reason = pause_reason(self.gate.under_pressure, len(self._running), self.knobs)
        if reason != self._pause:
            self.engine.set_speculation_paused(reason)
            if reason is not None:
                self.metrics.fallback(reason)
                log.info("speculation paused: %s (running batch %d)", reason, len(self._running))
            else:
                log.info("speculation pause lifted (was %s)", self._pause)
            self._pause = reason
        self._track_speculation()

    def _track_speculation(self) -> None:
        active = self.engine.speculation_active
        if active != self._speculating:
            self.metrics.speculation_enabled.set(1 if active else 0)
            # An engine-side switch-off (acceptance floor, knobs) counts as a fallback too.
            if self._speculating and not active and self._pause is None:
                reason = "acceptance_floor" if self.knobs.enabled else "disabled"
                self.metrics.fallback(reason)
                # SpeculativeEngine says why in words; the protocol does not require it.
                detail = getattr(self.engine, "speculation_off_reason", None) or reason
                log.warning("speculation turned off (%s): %s", reason, detail)
            self._speculating = active

    def _step(self) -> None:
        events = self.engine.step()
        now = time.monotonic()
        # Metrics first, replies second: a client that scrapes /metrics right after its
        # last chunk must see its request gone and the step that finished it counted.
        replies: list[Callable[[], None]] = []
        for event in events:
            submission = self._running.get(event.request_id)
            if submission is None:
                continue  # aborted between our bookkeeping and the step
            self.metrics.record_event(event)
            if event.text:
                if submission.first_text_at is None:
                    submission.first_text_at = now
                    self.metrics.ttft.observe(now - submission.arrival)
                elif submission.last_text_at is not None:
                    self.metrics.itl.observe(now - submission.last_text_at)
                submission.last_text_at = now
            if event.finish_reason == "error":
                # This row alone failed (e.g. non-finite probabilities); its
                # batch-mates go on. The detail is for the logs only.
                del self._running[event.request_id]
                log.error("request %s failed in the engine: %s", event.request_id, event.error)
                detail = event.error or "engine error"
                replies.append(partial(self._fail, submission, detail, "engine_error"))
                continue
            if event.finished:
                del self._running[event.request_id]
                self.metrics.request_latency.observe(now - submission.arrival)
                self.metrics.finished(event.finish_reason or "stop")
            replies.append(partial(submission.sink, Update(event=event)))
        try:
            self.metrics.requests_running.set(len(self._running))
            self._update_kv_slot_usage()
            # SpeculativeEngine measures its budget; the protocol does not require it.
            budget = getattr(self.engine, "step_tokens", None)
            if isinstance(budget, int):
                self.metrics.step_token_budget.set(budget)
            timing = getattr(self.engine, "last_step", None)
            if isinstance(timing, StepTiming):
                self.metrics.step(timing)
            self._track_speculation()
        finally:  # the requests that this step finished are no longer in _running
            for reply in replies:
                reply()

    def _update_kv_slot_usage(self) -> None:
        # SpeculativeEngine counts the requests holding a slot (one admitted this step
        # may still wait for one); the protocol does not require it. The server never
        # runs more requests than the engine has slots (EngineOptions.from_serving).
        holding = getattr(self.engine, "running", None)
        in_use = holding if isinstance(holding, int) else len(self._running)
        self.metrics.kv_slot_usage.set(in_use / self.max_batch_size)

    def _fail(self, submission: Submission, detail: str, code: ErrorCode) -> None:
        self.metrics.error(code)
        self.metrics.finished("error")
        submission.sink(Update(error=detail, error_code=code))

    def _fail_running(self, detail: str, code: ErrorCode) -> None:
        for submission in self._running.values():
            try:
                self.engine.abort(submission.request_id)
            except Exception:
                log.exception("abort of %s failed", submission.request_id)
            self._fail(submission, detail, code)
        self._running.clear()
        self.metrics.requests_running.set(0)
        self._update_kv_slot_usage()
        self.metrics.requests_waiting.set(len(self._queue))
