"""Drive an Engine through its step API until one request finishes.

The CLI streams through this (``on_text``), the golden check collects; both
see only target-verified tokens, because that is all ``step`` returns.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from specpair_runtime.engine.api import Engine, FinishReason, RequestStats, SamplingParams

_ids = itertools.count()


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    stats: RequestStats


def run_request(
    engine: Engine,
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    on_text: Callable[[str], None] | None = None,
) -> Completion:
    """Decode one prompt to completion; ``on_text`` gets each verified text chunk."""
    request_id = f"oneshot-{next(_ids)}"
    engine.add_request(request_id, prompt_ids, params)
    token_ids: list[int] = []
    chunks: list[str] = []
    finish_reason: FinishReason | None = None
    finished = False
    try:
        while not finished and engine.has_unfinished():
            for event in engine.step():
                if event.request_id != request_id:
                    continue
                token_ids.extend(event.token_ids)
                if event.text:
                    chunks.append(event.text)
                    if on_text is not None:
                        on_text(event.text)
                if event.finished:
                    finished = True
                    finish_reason = event.finish_reason
    except BaseException:
        engine.abort(request_id)
        raise
    stats = engine.stats(request_id)
    return Completion(token_ids, "".join(chunks), finish_reason, stats)
