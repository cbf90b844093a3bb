"""Commit: a row's sampled tokens become the request's output, and its cache lengths advance.

The accepted prefix is valid in both caches; a rejected draft is rolled back
by not advancing a length over it (its positions are overwritten later).
The output stream (``stopping.py``) applies EOS, stop strings and
``max_new_tokens`` and holds back text that may still change; the kept
tokens go to the request's output, its logits processors and its stats.
"""

from __future__ import annotations

import time

from specpair_runtime.engine.api import FinishReason, StepEvent
from specpair_runtime.engine.sampler import RowResult
from specpair_runtime.engine.scheduler import Row

NOT_FINITE = "the target's probabilities are not finite for this request"


def commit_row(row: Row, result: RowResult) -> StepEvent:
    """Apply one sampling row's result to its request; the event the step reports for it.

    A finished event (``finish_reason`` set) means the caller frees the slot.
    """
    request = row.request
    stats = request.stats
    stats.target_passes += 1
    if not result.ok:
        return StepEvent(
            request_id=request.id,
            token_ids=[],
            text="",
            drafted=0,
            accepted=0,
            finished=True,
            finish_reason="error",
            error=NOT_FINITE,
        )
    before = request.sequence_len
    first_output = not request.output_ids
    accepted = row.accepted = result.accepted
    request.target_len = before + accepted
    if row.num_draft:
        request.draft_len = before + min(accepted, row.num_draft - 1)
    elif row.draft_tokens:
        request.draft_len += len(row.draft_tokens)
    pushed = request.stream.push(result.tokens)
    request.output_ids.extend(pushed.token_ids)
    for processor in request.processors:
        processor.commit(pushed.token_ids)
    _count(row, len(pushed.token_ids))
    stats.elapsed_seconds = time.perf_counter() - request.started
    reason: FinishReason | None = pushed.finish_reason
    logprobs = result.logprobs
    return StepEvent(
        request_id=request.id,
        token_ids=pushed.token_ids,
        text=pushed.text,
        drafted=row.num_draft,
        accepted=accepted,
        finished=reason is not None,
        finish_reason=reason,
        cached_prompt_tokens=stats.cached_prompt_tokens if first_output else 0,
        # The kept tokens are a prefix of the committed ones (cut at a stop).
        logprobs=logprobs[: len(pushed.token_ids)] if logprobs is not None else None,
    )


def advance_prefill(row: Row) -> None:
    """A row that did not sample: its chunks are now in the caches."""
    row.request.target_len += len(row.target_tokens)
    row.request.draft_len += len(row.draft_tokens)


def _count(row: Row, generated: int) -> None:
    """The request's stats: tokens generated, and each draft position's acceptance."""
    stats = row.request.stats
    stats.generated_tokens += generated
    if not row.num_draft:
        return
    stats.drafted_tokens += row.num_draft
    stats.accepted_tokens += row.accepted
    stats.speculation_steps += 1
    while len(stats.accepted_per_position) < row.num_draft:
        stats.accepted_per_position.append(0)
    for position in range(row.accepted):
        stats.accepted_per_position[position] += 1
