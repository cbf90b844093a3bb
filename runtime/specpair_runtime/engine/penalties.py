"""Penalties and logit bias over the positions of a speculative step, with exact counts.

OpenAI's ``presence_penalty`` and ``frequency_penalty``, vLLM's
``repetition_penalty`` and OpenAI's ``logit_bias``, in vLLM's order:

    logit_bias   logits[t] += bias[t]
    repetition   for t in the prompt or the output so far:
                 logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r
    frequency    logits[t] -= frequency * count[t]      (count over the output so far)
    presence     logits[t] -= presence * (count[t] > 0)

"The output so far" differs between the positions of one speculative step.
A row verifying drafts ``d1..dn`` scores position ``j`` (0-based) after the
committed output *and* ``d1..dj``; the draft proposing ``d(j+1)`` sees the
same context. Each position gets its own counts, including the drafts
before it, so the target's penalised distribution at position ``j`` is the
one target-only decoding would use had ``d1..dj`` been sampled. That is
exact: position ``j`` only matters when ``d1..dj`` are all accepted, and
then they are the output. Target and draft call the same function, so the
draft proposes from the same penalised distribution family the target
verifies (the rejection sampler's ``p`` and ``q``).

Shapes: logits ``[N, V]``; a ``PenaltyRow`` names ``positions`` consecutive
rows of it starting at ``first_position``; drafts are a flat device tensor
``[D]`` (the sampler's layout). Nothing here reads device values on the host.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a bias value
BAN_BIAS = -MAX_LOGIT_BIAS  # OpenAI's "ban": the token is never sampled in practice


class PenaltyError(ValueError):
    """A penalty or bias out of range; ``field`` names the request field."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class Penalties:
    """A request's penalties; the defaults change nothing."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @staticmethod
    def of(
        presence: float = 0.0,
        frequency: float = 0.0,
        repetition: float = 1.0,
        logit_bias: Mapping[int, float] | None = None,
    ) -> Penalties:
        bias = tuple(sorted((int(t), float(b)) for t, b in (logit_bias or {}).items()))
        return Penalties(presence, frequency, repetition, bias)

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1.0 or self.logit_bias)

    @property
    def counts_output(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1.0)

    def validate(self, vocab_size: int) -> None:
        """Raise PenaltyError naming the first bad field."""
        for name, value in (
            ("presence_penalty", self.presence),
            ("frequency_penalty", self.frequency),
        ):
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise PenaltyError(name, f"must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition) and self.repetition > 0):
            raise PenaltyError("repetition_penalty", f"must be > 0, got {self.repetition}")
        for token, bias in self.logit_bias:
            if not 0 <= token < vocab_size:
                raise PenaltyError(
                    "logit_bias", f"token id {token} is outside the vocabulary [0, {vocab_size})"
                )
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise PenaltyError(
                    "logit_bias",
                    f"the bias of token {token} must be in "
                    f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}",
                )


@dataclass(frozen=True)
class PenaltyRow:
    """One request's rows in a logits tensor and the tokens they follow.

    Position ``i`` (0-based, ``i < positions``) is at logits row
    ``first_position + i`` and follows ``output_ids`` plus the drafts
    ``drafts[draft_start : draft_start + drafts_before + i]``: a verify has
    ``drafts_before = 0``; draft forward ``j`` scores one position after the
    row's first ``j`` drafts (``drafts_before = j``).
    """

    penalties: Penalties
    first_position: int
    positions: int
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    draft_start: int = 0
    drafts_before: int = 0


def _position_rows(rows: Sequence[PenaltyRow]) -> tuple[list[int], list[int]]:
    """Per penalised position: its logits row and the index of its PenaltyRow."""
    positions: list[int] = []
    owners: list[int] = []
    for r, row in enumerate(rows):
        positions += range(row.first_position, row.first_position + row.positions)
        owners += [r] * row.positions
    return positions, owners


def _scalars(rows: Sequence[PenaltyRow], owners: list[int], device: torch.device) -> torch.Tensor:
    """[3, P] float32: presence, frequency and repetition per position."""
    values = [
        [rows[o].penalties.presence for o in owners],
        [rows[o].penalties.frequency for o in owners],
        [rows[o].penalties.repetition for o in owners],
    ]
    return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)


def output_counts(
    rows: Sequence[PenaltyRow],
    owners: list[int],
    drafts: torch.Tensor | None,
    vocab: int,
    device: torch.device,
) -> torch.Tensor:
    """[P, V] float32: each position's token counts over the output before it (drafts included).

    ``owners``: the index into ``rows`` of every position, in order.
    """
    base = torch.zeros((len(rows), vocab), dtype=torch.float32, device=device)
    row_index = [r for r, row in enumerate(rows) for _ in row.output_ids]
    tokens = [t for row in rows for t in row.output_ids]
    if tokens:
        index = torch.tensor([row_index, tokens], dtype=torch.long).to(device, non_blocking=True)
        base.index_put_(
            (index[0], index[1]), torch.ones(len(tokens), device=device), accumulate=True
        )
    counts = base.index_select(0, torch.tensor(owners, dtype=torch.long).to(device))
    # The drafts before each position: (position, flat draft index) pairs.
    pairs_p: list[int] = []
    pairs_d: list[int] = []
    p = 0
    for row in rows:
        for i in range(row.positions):
            seen = row.drafts_before + i
            pairs_p += [p] * seen
            pairs_d += range(row.draft_start, row.draft_start + seen)
            p += 1
    if pairs_p:
        if drafts is None:
            raise ValueError("drafts: positions follow drafts, but no draft tokens were given")
        index = torch.tensor([pairs_p, pairs_d], dtype=torch.long).to(device, non_blocking=True)
        counts.index_put_(
            (index[0], drafts.index_select(0, index[1])),
            torch.ones(len(pairs_p), device=device),
            accumulate=True,
        )
    return counts


def _prompt_presence(
    rows: Sequence[PenaltyRow], owners: list[int], vocab: int, device: torch.device
) -> torch.Tensor:
    """[P, V] bool: the token occurs in the position's prompt (rows with a repetition penalty)."""
    present = torch.zeros((len(rows), vocab), dtype=torch.bool, device=device)
    row_index = [
        r for r, row in enumerate(rows) if row.penalties.repetition != 1.0 for _ in row.prompt_ids
    ]
    tokens = [t for row in rows if row.penalties.repetition != 1.0 for t in row.prompt_ids]
    if tokens:
        index = torch.tensor([row_index, tokens], dtype=torch.long).to(device, non_blocking=True)
        present[index[0], index[1]] = True
    return present.index_select(0, torch.tensor(owners, dtype=torch.long).to(device))


def _bias(
    rows: Sequence[PenaltyRow], owners: list[int], vocab: int, device: torch.device
) -> torch.Tensor | None:
    """[P, V] float32 logit bias per position, or None when no row has one."""
    if not any(row.penalties.logit_bias for row in rows):
        return None
    bias = torch.zeros((len(rows), vocab), dtype=torch.float32)
    for r, row in enumerate(rows):
        for token, value in row.penalties.logit_bias:
            bias[r, token] = value
    return bias.to(device, non_blocking=True).index_select(
        0, torch.tensor(owners, dtype=torch.long).to(device)
    )


def apply_penalties(
    logits: torch.Tensor, rows: Sequence[PenaltyRow], drafts: torch.Tensor | None = None
) -> None:
    """In place on logits [N, V]: bias, repetition, frequency, presence per row (in float32).

    ``drafts`` [D]: the step's flat draft tokens on the logits' device, for
    positions that follow drafts. Rows without active penalties are skipped.
    """
    rows = [row for row in rows if row.penalties.active and row.positions > 0]
    if not rows:
        return
    device, vocab = logits.device, logits.shape[-1]
    positions, owners = _position_rows(rows)
    index = torch.tensor(positions, dtype=torch.long).to(device, non_blocking=True)
    selected = logits.index_select(0, index).float()  # bf16 logits on CUDA: count in fp32
    bias = _bias(rows, owners, vocab, device)
    if bias is not None:
        selected += bias
    if any(row.penalties.counts_output for row in rows):
        presence, frequency, repetition = _scalars(rows, owners, device)[:, :, None]
        counts = output_counts(
            rows, owners, drafts.to(device) if drafts is not None else None, vocab, device
        )
        if any(row.penalties.repetition != 1.0 for row in rows):
            seen = (counts > 0) | _prompt_presence(rows, owners, vocab, device)
            scaled = torch.where(selected > 0, selected / repetition, selected * repetition)
            selected = torch.where(seen, scaled, selected)
        selected -= frequency * counts + presence * (counts > 0)
    logits.index_copy_(0, index, selected.to(logits.dtype))
