"""Drive an Engine through its step API until one request finishes.

The CLI streams through this (``on_text``), the golden check collects; both
see only target-verified tokens, because that is all ``step`` returns.
``RequestDriver`` advances one request a step at a time, so a caller can
interleave the steps of several engines (the benchmark's lockstep).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from specpair_runtime.engine.api import (
    Engine,
    FinishReason,
    RequestStats,
    SamplingParams,
    StepEvent,
)

_ids = itertools.count()


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    stats: RequestStats


class RequestDriver:
    """One request on one engine, advanced by ``step`` until it finishes."""

    def __init__(
        self,
        engine: Engine,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        on_text: Callable[[str], None] | None = None,
    ) -> None:
        self.engine = engine
        self.request_id = f"oneshot-{next(_ids)}"
        self._on_text = on_text
        self._token_ids: list[int] = []
        self._chunks: list[str] = []
        self._finish_reason: FinishReason | None = None
        self.finished = False
        engine.add_request(self.request_id, prompt_ids, params)

    def step(self) -> bool:
        """Run one engine step; True once the request has finished."""
        if self.finished or not self.engine.has_unfinished():
            self.finished = True
            return True
        try:  # the request leaves the engine if the step or the caller's on_text fails
            for event in self.engine.step():
                if event.request_id == self.request_id:
                    self._take(event)
        except BaseException:
            self.engine.abort(self.request_id)
            raise
        return self.finished

    def _take(self, event: StepEvent) -> None:
        self._token_ids.extend(event.token_ids)
        if event.text:
            self._chunks.append(event.text)
            if self._on_text is not None:
                self._on_text(event.text)
        if event.finished:
            self.finished = True
            self._finish_reason = event.finish_reason

    def completion(self) -> Completion:
        stats = self.engine.stats(self.request_id)
        return Completion(list(self._token_ids), "".join(self._chunks), self._finish_reason, stats)


def run_request(
    engine: Engine,
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    on_text: Callable[[str], None] | None = None,
) -> Completion:
    """Decode one prompt to completion; ``on_text`` gets each verified text chunk."""
    driver = RequestDriver(engine, prompt_ids, params, on_text=on_text)
    while not driver.step():
        pass
    return driver.completion()
