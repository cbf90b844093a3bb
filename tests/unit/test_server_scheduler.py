"""The scheduler's engine thread with the real engine over an in-memory tiny pair."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from tools.tiny_models import as_loaded, build_pair

from specpair_runtime.config import SpeculationKnobs
from specpair_runtime.engine.api import SamplingParams, StepEvent
from specpair_runtime.engine.speculative import SpeculativeEngine
from specpair_runtime.server.choices import Choice
from specpair_runtime.server.filters import build_filter
from specpair_runtime.server.generation import Generation
from specpair_runtime.server.memory import MemoryProbe
from specpair_runtime.server.metrics import ServerMetrics
from specpair_runtime.server.scheduler import QueueFull, Scheduler, Submission, Update
from specpair_runtime.server.streaming import completion_chunks
from tests.support.server_harness import eventually, metric_value

KNOBS = SpeculationKnobs(max_depth=3, adaptive=False, disable_above_batch_size=1)


class Sink:
    def __init__(self) -> None:
        self.updates: list[Update] = []
        self.done = threading.Event()

    def __call__(self, update: Update) -> None:
        self.updates.append(update)
        if update.finished:
            self.done.set()

    @property
    def text(self) -> str:
        return "".join(u.event.text for u in self.updates if u.event is not None)


@pytest.fixture(scope="module")
def engine() -> SpeculativeEngine:
    pair = build_pair()
    return SpeculativeEngine(
        as_loaded(pair.target, pair.tokenizer, "target"),
        as_loaded(pair.draft, pair.tokenizer, "draft"),
        KNOBS,
    )


@pytest.fixture
def scheduler(engine: SpeculativeEngine) -> Iterator[Scheduler]:
    sched = Scheduler(
        engine, KNOBS, ServerMetrics("p", "v"), MemoryProbe("cpu"), max_batch_size=2, max_waiting=1
    )
    sched.start()
    try:
        yield sched
    finally:
        sched.stop()


def submit(scheduler: Scheduler, name: str, params: SamplingParams, priority: int = 0) -> Sink:
    sink = Sink()
    scheduler.submit(Submission(name, [5, 6, 7, 8], params, sink, priority))
    return sink


def test_a_bad_request_fails_alone(scheduler: Scheduler) -> None:
    good = submit(scheduler, "good", SamplingParams(max_new_tokens=8))
    # Bypasses the HTTP schema; the engine refuses it at admission.
    bad = submit(scheduler, "bad", SamplingParams(max_new_tokens=8, top_p=0.0))
    assert bad.done.wait(60) and good.done.wait(60)
    assert bad.updates[-1].error is not None and "top_p" in bad.updates[-1].error
    last = good.updates[-1].event
    assert last is not None and last.finish_reason in ("length", "stop")
    metrics = scheduler.metrics.render().decode()
    assert metric_value(metrics, "specpair_requests_finished_total", finish_reason="error") == 1
    assert (
        metric_value(metrics, "specpair_requests_finished_total", finish_reason=last.finish_reason)
        == 1
    )


def test_queue_bound_abort_and_batch_size_pause(scheduler: Scheduler) -> None:
    long = SamplingParams(max_new_tokens=200)
    first = submit(scheduler, "a", long)
    second = submit(scheduler, "b", long)  # fills the batch of 2 at the next step
    third = submit(scheduler, "c", long)  # the one waiting place
    with pytest.raises(QueueFull):
        submit(scheduler, "d", long)
    deadline = time.monotonic() + 60
    while scheduler.running < 2:  # both admitted; c stays queued behind them
        assert time.monotonic() < deadline, "a and b were not admitted"
        time.sleep(0.01)

    def both_slots_held() -> None:
        text = scheduler.metrics.render().decode()
        assert metric_value(text, "specpair_kv_slot_usage") == 1.0  # 2 of 2 slots

    eventually(both_slots_held)
    scheduler.abort("c")  # still queued: dropped without reaching the engine
    scheduler.abort("a")
    assert first.done.wait(60)
    last = first.updates[-1].event
    assert last is not None and last.finish_reason == "abort"
    assert second.done.wait(120)
    assert third.done.is_set() and len(third.updates) == 1
    aborted = third.updates[0].event
    assert aborted is not None and aborted.finish_reason == "abort" and not aborted.token_ids
    # Two running requests exceed disableAboveBatchSize=1: a batch-size pause was counted.
    metrics = scheduler.metrics.render().decode()
    assert metric_value(metrics, "specpair_fallback_total", reason="batch_size") >= 1
    assert metric_value(metrics, "specpair_requests_running") == 0
    assert metric_value(metrics, "specpair_kv_slot_usage") == 0
    # Each request counted once, by how it ended: a and c aborted, b ran out or stopped.
    finished = {
        reason: metric_value(metrics, "specpair_requests_finished_total", finish_reason=reason)
        for reason in ("stop", "length", "abort", "content_filter", "error")
    }
    assert finished["abort"] == 2 and finished["stop"] + finished["length"] == 1
    assert finished["content_filter"] == finished["error"] == 0
    # a and b waited for a slot; c left the queue without one.
    assert metric_value(metrics, "specpair_request_queue_time_seconds_count") == 2


def test_metrics_are_up_to_date_when_a_request_hears_it_finished(
    engine: SpeculativeEngine,
) -> None:
    """A client that scrapes /metrics right after its last chunk sees its request
    gone from ``specpair_requests_running`` and the step that finished it counted:
    the gauge is set before the replies go out, or a fast client could race it."""
    metrics = ServerMetrics("p", "v")
    sched = Scheduler(engine, KNOBS, metrics, MemoryProbe("cpu"), max_batch_size=2, max_waiting=1)
    seen: list[tuple[float, float]] = []

    class Scraping(Sink):
        def __call__(self, update: Update) -> None:
            if update.finished:
                text = metrics.render().decode()
                steps = sum(
                    metric_value(text, "specpair_step_seconds_count", kind=kind)
                    for kind in ("decode", "mixed", "prefill")
                )
                seen.append((metric_value(text, "specpair_requests_running"), steps))
            super().__call__(update)

    sink = Scraping()
    sched.start()
    try:
        sched.submit(Submission("r", [5, 6, 7, 8], SamplingParams(max_new_tokens=1), sink, 0))
        assert sink.done.wait(60)
    finally:
        sched.stop()
    # One token: the prefill step samples it and finishes the request.
    assert seen == [(0.0, 1.0)]


def test_prompt_tokens_count_admitted_requests_and_cached_ones_as_reported(
    engine: SpeculativeEngine,
) -> None:
    """``specpair_prompt_tokens`` counts the prompts the engine admitted, not one it
    refused; ``specpair_prompt_tokens_cached`` sums what the events report reused,
    so their ratio is prefix reuse's hit ratio whatever the engine reused."""
    metrics = ServerMetrics("p", "v")
    sched = Scheduler(engine, KNOBS, metrics, MemoryProbe("cpu"), max_batch_size=2, max_waiting=1)
    sinks: list[Sink] = []
    sched.start()
    try:
        # The same prompt twice, one after the other: the second may reuse the first's KV.
        for name in ("first", "again"):
            sinks.append(submit(sched, name, SamplingParams(max_new_tokens=4)))
            assert sinks[-1].done.wait(60)
        refused = submit(sched, "refused", SamplingParams(max_new_tokens=4, top_p=0.0))
        assert refused.done.wait(60) and refused.updates[-1].error is not None
    finally:
        sched.stop()
    text = metrics.render().decode()
    assert metric_value(text, "specpair_prompt_tokens_total", pair="p", pair_version="v") == 8
    cached = [u.event.cached_prompt_tokens for s in sinks for u in s.updates if u.event]
    assert all(0 <= n < 4 for n in cached), cached  # the first output token is computed
    assert metric_value(text, "specpair_prompt_tokens_cached_total") == sum(cached)


def test_cached_prompt_tokens_are_counted_from_any_event() -> None:
    metrics = ServerMetrics("p", "v")
    metrics.record_event(StepEvent("r1", [7], "a", 0, 0, cached_prompt_tokens=12))
    metrics.record_event(StepEvent("r2", [8, 9], "bc", 2, 1, cached_prompt_tokens=5))
    metrics.record_event(StepEvent("r1", [10], "d", 0, 0))  # later events carry 0
    text = metrics.render().decode()
    assert metric_value(text, "specpair_prompt_tokens_cached_total") == 17
    assert metric_value(text, "specpair_prompt_tokens_total") == 0  # counted at admission


def test_usage_reports_the_reused_prompt_tokens(engine: SpeculativeEngine) -> None:
    """The events' ``cached_prompt_tokens`` reach ``usage.prompt_tokens_details`` of the
    include_usage chunk; the closing chunk carries no usage (it would count twice)."""
    # Never started: the test plays the engine thread and calls the request's sink.
    sched = Scheduler(
        engine, KNOBS, ServerMetrics("p", "v"), MemoryProbe("cpu"), max_batch_size=2, max_waiting=1
    )

    async def stream() -> list[dict[str, Any]]:
        generation = Generation(
            sched, build_filter(None), "r", [5, 6, 7, 8], SamplingParams(max_new_tokens=2), 0
        )
        sink = generation._submission.sink
        sink(Update(event=StepEvent("r", [9], "a", 0, 0, cached_prompt_tokens=3)))
        sink(Update(event=StepEvent("r", [10], "b", 0, 0, finished=True, finish_reason="length")))
        choices = [Choice(0, 0, generation)]
        chunks = [c async for c in completion_chunks(choices, "cmpl-r", 0, "tiny", True)]
        assert chunks[-1] == "[DONE]"
        return [json.loads(chunk) for chunk in chunks[:-1]]

    *_, last, usage_only = asyncio.run(stream())
    expected = {
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "total_tokens": 6,
        "prompt_tokens_details": {"cached_tokens": 3},
    }
    assert last["choices"][0]["finish_reason"] == "length" and last["usage"] is None
    assert usage_only["choices"] == [] and usage_only["usage"] == expected
