"""The step's sampler: the target's verify logits and the draft's proposal -> committed tokens.

Over the sampling rows of a step (``layout``: ``num_draft`` per row), with
the target's logits ``[D + R, V]`` and the proposal's ``tokens [D]`` and
``probs [D, V]``: each row's processors run on its positions (``logits_
processors.py``), then either the greedy verify (every row greedy: accept
while the draft is the argmax) or the rejection sampler
(``sampling.rejection_sample``) picks the accepted drafts and one recovered
or bonus token per row. A row whose distribution is not finite fails alone.

Everything stays on the device until ``read``: the step's one device-to-host
copy of the output tokens ``[R, K + 1]``, the accepted counts ``[R]`` and the
row health ``[R]`` (the logprobs of rows that asked, queued before it, are
read right after it).

Greedy rows and seeded rows are verified alike: each verify position has one
token of the target's (its argmax, or for a seeded row its Gumbel-max token,
``sampling.coupled_tokens``), and a draft is accepted while it is that
token. Other sampled rows go through the rejection sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specpair_runtime.engine.api import TokenLogprob
from specpair_runtime.engine.drafter import Proposal
from specpair_runtime.engine.logits_processors import process_rows
from specpair_runtime.engine.logprobs import LogprobRequest, read_committed, score_committed
from specpair_runtime.engine.sampling import (
    FlatLayout,
    SamplingTensors,
    StepIndex,
    coupled_tokens,
    finite_rows,
    greedy_verify,
    is_greedy_temperature,
    probabilities,
    rejection_sample,
    sanitize,
)
from specpair_runtime.engine.scheduler import Row


@dataclass(frozen=True)
class RowResult:
    """What one sampling row commits: its tokens (accepted drafts, then one more)."""

    tokens: list[int]
    accepted: int
    ok: bool  # False: the target's distribution was not finite; nothing is committed
    logprobs: list[TokenLogprob] | None


def sample(
    rows: list[Row], layout: FlatLayout, logits: torch.Tensor, proposal: Proposal
) -> list[RowResult]:
    """Accept, recover and add bonus tokens for the sampling ``rows``; one host sync."""
    device = logits.device
    index = StepIndex.of(layout, device)
    params = SamplingTensors.for_rows(
        [r.request.params for r in rows], [n + 1 for n in layout.num_draft], device
    )
    processed = _processed(rows, layout, logits, proposal)
    if params.all_greedy:
        position_ok = _finite_argmax(logits, processed)
        argmax = processed.argmax(dim=-1)
        output, accepted = greedy_verify(proposal.tokens, argmax, index, layout)
    else:
        probs = probabilities(processed, params)
        position_ok = finite_rows(probs)
        probs = sanitize(probs, position_ok)
        output, accepted = _sample_mixed(rows, layout, index, processed, probs, proposal)
    row_ok = torch.ones(layout.rows, dtype=torch.long, device=device)
    row_ok.scatter_reduce_(0, index.target_row, position_ok.long(), reduce="amin")
    wanted = LogprobRequest.of([row.request.params.logprobs for row in rows])
    pending = score_committed(logits, output, layout, wanted) if wanted.rows else None
    committed, counts, oks = read(output, accepted, row_ok, layout)
    scored = read_committed(pending, [committed[r] for r in wanted.rows]) if pending else {}
    return [
        RowResult(committed[r], counts[r], bool(oks[r]), scored.get(r)) for r in range(len(rows))
    ]


def _sample_mixed(
    rows: list[Row],
    layout: FlatLayout,
    index: StepIndex,
    processed: torch.Tensor,
    probs: torch.Tensor,
    proposal: Proposal,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output [R, K + 1] and accepted counts [R] of a batch that samples some rows.

    Greedy and seeded rows take the verify of their target tokens; the other
    rows the rejection sampler.
    """
    targets = processed.argmax(dim=-1)
    exact = [False] * len(rows)
    for r, row in enumerate(rows):
        seed = row.request.seed
        exact[r] = seed is not None or is_greedy_temperature(row.request.params.temperature)
        if seed is not None:
            start, width = layout.target_start[r], layout.num_draft[r] + 1
            first = len(row.request.output_ids)
            targets[start : start + width] = coupled_tokens(
                probs[start : start + width], seed, first
            )
    output, accepted = greedy_verify(proposal.tokens, targets, index, layout)
    if all(exact):
        return output, accepted
    draft_probs = proposal.probs
    if draft_probs is None and layout.total_draft:
        # Greedy drafting rows beside sampled ones: q is one-hot at the draft token.
        shape = (layout.total_draft, probs.shape[-1])
        draft_probs = torch.zeros(shape, dtype=torch.float32, device=probs.device).scatter_(
            1, proposal.tokens[:, None], 1.0
        )
    sampled, counts = rejection_sample(
        proposal.tokens, draft_probs, probs, [None] * len(rows), index, layout
    )
    keep = torch.tensor(exact, device=probs.device)
    return torch.where(keep[:, None], output, sampled), torch.where(keep, accepted, counts)


def read(
    output: torch.Tensor, accepted: torch.Tensor, row_ok: torch.Tensor, layout: FlatLayout
) -> tuple[list[list[int]], list[int], list[int]]:
    """The one host sync of the step: (committed tokens per row, accepted counts, row health)."""
    packed = torch.cat([output.flatten(), accepted, row_ok]).tolist()
    rows, width = layout.rows, layout.max_draft + 1
    counts = packed[rows * width : rows * width + rows]
    oks = packed[rows * width + rows :]
    committed = [packed[r * width : r * width + n + 1] for r, n in enumerate(counts)]
    return committed, counts, oks


def _finite_argmax(logits: torch.Tensor, processed: torch.Tensor) -> torch.Tensor:
    """[N] bool: the raw logits are finite and the processors left a token to pick."""
    ok = torch.isfinite(logits).all(dim=-1)
    if processed is logits:
        return ok
    return ok & ~torch.isnan(processed).any(dim=-1) & (processed.amax(dim=-1) > float("-inf"))


def _processed(
    rows: list[Row], layout: FlatLayout, logits: torch.Tensor, proposal: Proposal
) -> torch.Tensor:
    """The verify logits after each row's processors (the raw ones where none asked).

    A row's position ``i`` follows its first ``i`` drafts, read on the host.
    """
    with_processors = [r for r, row in enumerate(rows) if row.request.processors]
    if not with_processors:
        return logits
    drafts = proposal.tokens.tolist()
    return process_rows(
        logits,
        [
            (
                layout.target_start[r],
                layout.num_draft[r] + 1,
                rows[r].request.processors,
                drafts[layout.draft_start[r] : layout.draft_start[r] + layout.num_draft[r]],
            )
            for r in with_processors
        ],
    )
