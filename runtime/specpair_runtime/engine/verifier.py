"""The target's verify pass: ONE flat forward over every row of a step.

The flat batch is ``input_ids [T]`` with ``T = sum(len(target_tokens) +
num_draft)``: a decoding row ``[last, d1..dn]``, a prefilling row its prompt
chunk. Each token sits at its own position in its own sequence
(``RowSpan.position``). The drafts stay on the device: the row's slots hold
placeholders on the host and the draft tokens are scattered in.

The logits come back only at the positions that sample, ``[N, V]`` with
``N = D + R'``: for each of the ``R'`` sampling rows its ``num_draft + 1``
positions in row order (vLLM's layout, ``sampling.FlatLayout``); a prefilling
row that does not reach its prompt's end only writes its KV.
"""

from __future__ import annotations

import torch

from specpair_runtime.engine.drafter import Proposal, device_ids
from specpair_runtime.engine.kvcache import RowSpan
from specpair_runtime.engine.runner import ModelRunner
from specpair_runtime.engine.scheduler import Row


def verify_batch(rows: list[Row]) -> tuple[list[RowSpan], list[int], list[int], list[int]]:
    """The flat batch of ``rows``: (spans, host ids, draft slots, sampled positions).

    Draft slots hold 0 on the host; the verify pass places the drafts there.
    """
    spans: list[RowSpan] = []
    ids: list[int] = []
    sample_at: list[int] = []
    draft_at: list[int] = []
    for row in rows:
        request = row.request
        width = len(row.target_tokens) + row.num_draft
        spans.append(RowSpan(request.slot, len(ids), width, request.target_len))
        ids += row.target_tokens
        if row.num_draft:
            draft_at += range(len(ids), len(ids) + row.num_draft)
            ids += [0] * row.num_draft
        if row.samples:
            first = len(ids) - 1 - row.num_draft
            sample_at += range(first, len(ids))
    return spans, ids, draft_at, sample_at


def verify(target: ModelRunner, rows: list[Row], proposal: Proposal) -> torch.Tensor | None:
    """Run the target over the step; logits [D + R', V] at the sampled positions, or None."""
    spans, ids, draft_at, sample_at = verify_batch(rows)
    flat_ids = device_ids(ids, target.device)
    if draft_at:
        flat_ids[device_ids(draft_at, target.device)] = proposal.tokens
    where = device_ids(sample_at, target.device) if sample_at else None
    return target.forward(spans, flat_ids, where)
