"""Token bitmasks: which tokens a grammar allows at a position, and their effect on logits.

A bitmask row is ``W = ceil(V / 32)`` int32 words; token ``t`` is allowed when
bit ``t % 32`` of word ``t // 32`` is set (llguidance's and xgrammar's
layout). Grammar engines write rows on the host; ``apply_bitmask`` turns
disallowed logits into -inf on the logits' device.
"""

from __future__ import annotations

import torch

BITS = 32
_SHIFTS = torch.arange(BITS, dtype=torch.int32)


def words(vocab_size: int) -> int:
    """Int32 words per bitmask row for ``vocab_size`` tokens."""
    return (vocab_size + BITS - 1) // BITS


def allocate(rows: int, vocab_size: int) -> torch.Tensor:
    """A host bitmask [rows, W] int32 with every token allowed."""
    return torch.full((rows, words(vocab_size)), -1, dtype=torch.int32)


def allows(row: torch.Tensor, token: int) -> bool:
    """Whether the bitmask row [W] (host) allows ``token``."""
    if not 0 <= token < row.numel() * BITS:
        return False
    return bool((int(row[token // BITS]) >> (token % BITS)) & 1)


def allowed_tokens(row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] bool: the tokens the bitmask row [W] allows."""
    return unpack(row[None], vocab_size)[0]


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bitmask [P, W] int32 -> [P, V] bool (True: allowed)."""
    shifts = _SHIFTS.to(bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, positions: torch.Tensor) -> None:
    """In place: logits [N, V] get -inf where bitmask [P, W] forbids, at rows ``positions`` [P].

    ``positions``: long indices into the logits' rows, one per bitmask row (on
    the logits' device); rows not named are left alone.
    """
    if positions.numel() == 0:
        return
    allowed = unpack(bitmask.to(logits.device, non_blocking=True), logits.shape[-1])
    selected = logits.index_select(0, positions)
    logits.index_copy_(0, positions, selected.masked_fill(~allowed, float("-inf")))
