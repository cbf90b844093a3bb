"""The drafter: the draft model's forwards of one step, and the tokens they propose.

Forward 0 is one flat ragged batch: every row with ``draft_tokens`` feeds
them (a decoding row the committed tokens its draft has not seen, usually
1-2; any other row a catch-up chunk of its prompt), and each drafting row
gets logits for its first draft token. Forwards 1..k-1 feed one drafted
token per row that still drafts. A row leaves the later forwards when it
has drafted its ``num_draft`` tokens, or when the draft itself expects its
drafts to be rejected: the product of the probabilities it gave them (its
estimate that all of them are accepted) is below ``draftConfidence``,
where that is set. A token pays only if every one before it is accepted,
so the product, not the last token's own probability, is compared with the
bar. The rule reads a row's own draft distribution only, so it is lossless
and a row stops where it would alone, whatever its batch-mates.

Shapes: the proposal is flat over the drafting rows in step order (vLLM's
layout): ``tokens [D]``, ``D = sum(num_draft)``, row r's drafts from
``FlatLayout.draft_start[r]``; ``probs [D, V]``, the processed draft
distribution q of each draft over the target's ids (None when every drafting
row is greedy: q is then one-hot and never read).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specpair_runtime.engine.kvcache import RowSpan
from specpair_runtime.engine.logits_processors import process_rows
from specpair_runtime.engine.runner import ModelRunner
from specpair_runtime.engine.sampling import (
    FlatLayout,
    SamplingTensors,
    coupled_tokens,
    draft_confidence,
    draft_sample,
)
from specpair_runtime.engine.scheduler import Row


@dataclass(frozen=True)
class Proposal:
    """The draft tokens of a step (shapes in the module docstring)."""

    tokens: torch.Tensor  # [D] long
    probs: torch.Tensor | None  # [D, V] float32, or None


def fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft logits over the target's id range: cut extra columns, pad missing ones with -inf."""
    width = logits.shape[-1]
    if width == vocab:
        return logits
    if width > vocab:
        return logits[..., :vocab]
    pad = logits.new_full((*logits.shape[:-1], vocab - width), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


def device_ids(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """A host list of ids as a long tensor on ``device`` (copied without waiting)."""
    return torch.tensor(list(values), dtype=torch.long).to(device, non_blocking=True)


@dataclass
class _Drafting:
    """The state of one step's drafting, over its drafting rows."""

    rows: list[Row]
    layout: FlatLayout  # as planned; rows the stop cuts leave unused entries
    tokens: torch.Tensor  # [D planned]
    params: SamplingTensors  # one position per drafting row
    threshold: float
    probs: torch.Tensor | None = None  # [D planned, V]
    reach: list[float] = field(default_factory=list)  # the product of each row's q(draft)
    proposed: list[list[int]] = field(default_factory=list)  # host drafts (processor rows)


class Drafter:
    """Runs the draft model's forwards of a step (module docstring)."""

    def __init__(self, runner: ModelRunner, vocab: int) -> None:
        self.runner = runner
        self.vocab = vocab  # the target's logits width
        self.device = runner.device

    def empty(self) -> Proposal:
        return Proposal(torch.empty(0, dtype=torch.long, device=self.device), None)

    def propose(self, rows: list[Row], depth: int, threshold: float) -> Proposal:
        """Draft up to ``depth`` tokens per drafting row; catch the others' drafts up.

        ``threshold``: the confidence stop's bar (0 = off). Cuts ``num_draft``
        of the rows that stop early.
        """
        drafting = [r for r in rows if r.num_draft > 0]
        layout = FlatLayout.of([r.num_draft for r in drafting])
        state = _Drafting(
            rows=drafting,
            layout=layout,
            tokens=torch.empty(layout.total_draft, dtype=torch.long, device=self.device),
            params=SamplingTensors.for_rows(
                [r.request.params for r in drafting], [1] * len(drafting), self.device
            ),
            threshold=threshold,
            reach=[1.0] * len(drafting),
            proposed=[[] for _ in drafting],
        )
        logits = self._read(rows)
        for position in range(depth):
            active = [i for i, r in enumerate(drafting) if r.num_draft > position]
            if not active or logits is None:
                break
            drafted, following = self._sample(state, active, position, logits)
            if not following:
                break
            logits = self._feed(state, active, following, drafted, position)
        return _drop_unused(state)

    def _read(self, rows: list[Row]) -> torch.Tensor | None:
        """Forward 0 over every row's ``draft_tokens``: logits [drafting rows, V'] or None."""
        spans: list[RowSpan] = []
        ids: list[int] = []
        sample_at: list[int] = []
        for row in rows:
            if not row.draft_tokens:
                continue
            request = row.request
            spans.append(RowSpan(request.slot, len(ids), len(row.draft_tokens), request.draft_len))
            ids += row.draft_tokens
            if row.draft_samples:
                sample_at.append(len(ids) - 1)
        if not spans:
            return None
        where = device_ids(sample_at, self.device) if sample_at else None
        return self.runner.forward(spans, device_ids(ids, self.device), where)

    def _sample(
        self, state: _Drafting, active: list[int], position: int, logits: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]]:
        """Draft ``position`` of the ``active`` rows from their logits [A, V'].

        Returns the drafted tokens [A] and the rows that draft another token.
        """
        rows = state.rows
        if len(active) < len(rows):
            params = state.params.select(device_ids(active, self.device), active)
        else:
            params = state.params
        fitted = fit_vocab(logits, self.vocab)
        processed = [(k, i) for k, i in enumerate(active) if rows[i].request.processors]
        fitted = process_rows(
            fitted, [(k, 1, rows[i].request.processors, state.proposed[i]) for k, i in processed]
        )
        drafted, probs = draft_sample(fitted, params, [None] * len(active))
        if probs is not None:
            _couple_seeded(state, active, position, drafted, probs)
        where = device_ids([state.layout.draft_start[i] + position for i in active], self.device)
        state.tokens[where] = drafted
        if probs is not None:
            if state.probs is None:
                shape = (state.layout.total_draft, self.vocab)
                state.probs = torch.zeros(shape, dtype=torch.float32, device=self.device)
            state.probs[where] = probs
        if processed:  # a host read, for the processors' next position
            host = drafted.tolist()
            for k, i in processed:
                state.proposed[i].append(host[k])
        following = [i for i in active if rows[i].num_draft > position + 1]
        if following and state.threshold > 0.0:
            confidence = draft_confidence(fitted, drafted, probs, params)
            _confidence_stop(state, active, confidence.tolist(), position)
            following = [i for i in following if rows[i].num_draft > position + 1]
        return drafted, following

    def _feed(
        self,
        state: _Drafting,
        active: list[int],
        following: list[int],
        drafted: torch.Tensor,
        position: int,
    ) -> torch.Tensor | None:
        """One forward over the drafts of the rows that go on: logits [F, V']."""
        keep = [active.index(i) for i in following]
        if len(keep) < len(active):
            drafted = drafted.index_select(0, device_ids(keep, self.device))
        spans = [
            RowSpan(state.rows[i].request.slot, j, 1, state.rows[i].request.sequence_len + position)
            for j, i in enumerate(following)
        ]
        return self.runner.forward(spans, drafted, device_ids(range(len(following)), self.device))


def _couple_seeded(
    state: _Drafting, active: list[int], position: int, drafted: torch.Tensor, probs: torch.Tensor
) -> None:
    """Seeded rows propose the Gumbel-max token of q under the noise the target will use."""
    for k, i in enumerate(active):
        request = state.rows[i].request
        seed = request.seed
        if seed is not None:
            first = len(request.output_ids) + position
            drafted[k] = coupled_tokens(probs[k : k + 1], seed, first)[0]


def _confidence_stop(
    state: _Drafting, active: list[int], confidence: list[float], position: int
) -> None:
    """Cut each active row whose product of draft probabilities fell below the bar.

    The row's last draft is still verified; a host read, free on the CPU.
    """
    for i, sure in zip(active, confidence, strict=True):
        state.reach[i] *= sure
        row = state.rows[i]
        if state.reach[i] < state.threshold and row.num_draft > position + 1:
            row.num_draft = position + 1


def _drop_unused(state: _Drafting) -> Proposal:
    """The proposal of the rows' final ``num_draft``, where the stop cut rows short."""
    num_draft = [r.num_draft for r in state.rows]
    if num_draft == state.layout.num_draft:
        return Proposal(state.tokens, state.probs)
    kept = [
        start + j
        for start, n in zip(state.layout.draft_start, num_draft, strict=True)
        for j in range(n)
    ]
    index = device_ids(kept, state.tokens.device)
    probs = state.probs.index_select(0, index) if state.probs is not None else None
    return Proposal(state.tokens.index_select(0, index), probs)
