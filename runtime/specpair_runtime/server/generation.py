"""One request's generation as seen from the HTTP side.

The engine thread pushes ``Update``s into an asyncio queue; ``chunks()`` turns
them into releasable pieces. Only ``StepEvent.text`` is ever released, which
the engine fills with target-verified tokens after the stop-string hold-back,
and the output filter sees exactly what is about to be released, before it
is released. A generator that is closed early (client gone) aborts the
request so that its batch slot frees.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from specpair_runtime.engine.api import FinishReason, SamplingParams, TokenLogprob
from specpair_runtime.server.filters import OutputFilter
from specpair_runtime.server.mailbox import mailbox_for
from specpair_runtime.server.scheduler import ErrorCode, Scheduler, Submission, Update
from specpair_runtime.server.schemas import PromptTokensDetails, SpeculationStats, Usage

log = logging.getLogger("specpair.server")


# What a client is told for each failure: fixed text, never an exception's.
PUBLIC_ERRORS: dict[ErrorCode, tuple[int, str]] = {
    "engine_error": (500, "the server failed while generating this request"),
    "invalid_request": (400, "the engine refused this request's sampling parameters"),
    "shutting_down": (503, "server is shutting down"),
}


class GenerationError(RuntimeError):
    """The engine failed the request (or the server stopped under it)."""

    def __init__(self, code: ErrorCode) -> None:
        self.code = code
        self.status, self.public_message = PUBLIC_ERRORS[code]
        super().__init__(self.public_message)


@dataclass(frozen=True)
class Chunk:
    """Releasable text of one accept step; ``finish_reason`` set on the last chunk.

    ``logprobs``: the entries of the tokens committed since the last chunk (when
    the request asked for them). Tokens whose text is held back (a stop-string
    prefix, an incomplete character) send theirs with the next chunk.
    """

    text: str
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] = ()


class Generation:
    def __init__(
        self,
        scheduler: Scheduler,
        output_filter: OutputFilter,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int,
    ) -> None:
        self.scheduler = scheduler
        self.output_filter = output_filter
        self.request_id = request_id
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens reused, not computed (prefix reuse)
        self.drafted = 0
        self.accepted = 0
        self.steps = 0
        self.released = ""
        self.released_logprobs: list[TokenLogprob] = []  # what the chunks carried
        self._held_logprobs: list[TokenLogprob] = []  # committed, not yet sent
        self._queue: asyncio.Queue[Update] = asyncio.Queue()
        self._mailbox = mailbox_for(asyncio.get_running_loop())
        self._finished = False
        self._submission = Submission(
            request_id=request_id,
            prompt_ids=prompt_ids,
            params=params,
            sink=self._sink,
            priority=priority,
        )

    def _sink(self, update: Update) -> None:
        # Called on the engine thread: one loop wake-up for all of a step's updates.
        self._mailbox.post(self._queue.put_nowait, update)

    def submit(self) -> None:
        """Queue the request now (raises QueueFull), before any response starts."""
        self.scheduler.submit(self._submission)

    def abort(self, reason: FinishReason = "abort") -> None:
        if not self._finished:
            self._finished = True
            self.scheduler.abort(self.request_id, reason)

    @property
    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
        )

    @property
    def speculation(self) -> SpeculationStats:
        rate = self.accepted / self.drafted if self.drafted else 0.0
        return SpeculationStats(
            drafted=self.drafted, accepted=self.accepted, acceptance_rate=rate, steps=self.steps
        )

    async def chunks(self) -> AsyncIterator[Chunk]:
        """One chunk per accept step with text; the last one carries the finish reason."""
        try:
            while True:
                update = await self._queue.get()
                if update.error is not None:
                    # The scheduler logged the detail and counted the failure.
                    self._finished = True
                    raise GenerationError(update.error_code)
                event = update.event
                if event is None:
                    continue
                self.completion_tokens += len(event.token_ids)
                # Nonzero on the first event with output only; summed to be safe.
                self.cached_tokens += event.cached_prompt_tokens
                if event.drafted:
                    self.drafted += event.drafted
                    self.accepted += event.accepted
                    self.steps += 1
                text = event.text
                self._held_logprobs += event.logprobs or ()
                if text:
                    refusal = self.output_filter.check(self.released + text)
                    if refusal is not None:
                        log.info(
                            "request %s stopped by the output filter: %s", self.request_id, refusal
                        )
                        self.abort("content_filter")
                        yield Chunk("", "content_filter")
                        return
                    self.released += text
                if event.finished:
                    self._finished = True
                    yield Chunk(text, event.finish_reason or "stop", self._release_logprobs())
                    return
                if text:
                    yield Chunk(text, logprobs=self._release_logprobs())
        finally:
            # Closed early (client disconnect, cancellation): free the slot.
            self.abort()

    def _release_logprobs(self) -> tuple[TokenLogprob, ...]:
        released = tuple(self._held_logprobs)
        self.released_logprobs += released
        self._held_logprobs.clear()
        return released

    async def collect(self, disconnected: asyncio.Event) -> tuple[str, FinishReason]:
        """The whole text; aborts when ``disconnected`` is set first."""
        parts: list[str] = []
        finish: FinishReason = "abort"

        async def consume() -> None:
            nonlocal finish
            async for chunk in self.chunks():
                parts.append(chunk.text)
                if chunk.finish_reason is not None:
                    finish = chunk.finish_reason

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(disconnected.wait())
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not consumer.done():
                consumer.cancel()
                self.abort()
        if consumer.done() and not consumer.cancelled():
            consumer.result()  # re-raise a GenerationError
        return "".join(parts), finish
