"""KV caches with holes: rollback, row select/merge and compaction.

One ``RaggedCache`` per model holds the whole running batch in a single
transformers ``DynamicCache`` ([B, heads, L, head_dim] per layer), so a
batch decodes with one forward per model. Rows accept different numbers of
draft tokens, so a row's rejected positions cannot simply be cut off the
shared tensor. Instead ``valid`` ([B, L] bool) marks each physical slot as a
real token or a *hole* (rolled back, or padding); the attention mask hides
holes, and position ids count only real tokens, so a row with holes computes
exactly what it would compute alone. Columns that are holes in every row are
cropped for real, so a batch of one never has holes at all, and ``compact``
squeezes the holes out when they pile up.

Batches are only ever right-padded: every query slot then sees at least its
row's first real token, so no attention row is fully masked (that would give
NaNs, and NaN values poison later sums even under a zero weight).

transformers 5.24 quirk: ``DynamicCache.crop`` takes a negative count of
tokens to remove (a positive count raises).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# Compact when holes exceed this share of the physical length (and MIN_HOLES).
HOLE_SHARE = 0.25
MIN_HOLES = 32


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of every layer (in place)."""
    tensors = cache_tensors(cache)
    # Not get_seq_length(): it reads 0 for a cache with zero rows.
    current = int(tensors[0][0].shape[2]) if tensors else 0
    if length < current:
        cache.crop(length - current)  # negative: the number of tokens to remove


def cache_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per initialised layer, each [B, heads, L, head_dim]."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in cache.layers:
        if not isinstance(layer, DynamicLayer):
            raise TypeError(f"unsupported cache layer {type(layer).__name__}")
        if layer.is_initialized and layer.keys is not None and layer.values is not None:
            out.append((layer.keys, layer.values))
    return out


def cache_from_tensors(tensors: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    return DynamicCache(ddp_cache_data=list(tensors))


@dataclass(frozen=True)
class ForwardInputs:
    """What a forward over a ragged chunk needs besides the token ids."""

    position_ids: torch.Tensor  # [B, W] long
    attention_mask: torch.Tensor | None  # [B, 1, W, L+W] additive float, None when no holes


class RaggedCache:
    """A batched DynamicCache with per-row holes (see the module docstring)."""

    def __init__(self, rows: int, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self.cache = DynamicCache()
        self.valid = torch.zeros((rows, 0), dtype=torch.bool, device=device)
        self.lengths: list[int] = [0] * rows  # real tokens per row (= next position id)

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def physical_length(self) -> int:
        return int(self.valid.shape[1])

    @property
    def holes(self) -> int:
        return self.rows * self.physical_length - sum(self.lengths)

    def prepare(self, chunk_lens: Sequence[int], width: int) -> ForwardInputs:
        """Inputs for a forward that appends ``width`` slots to every row.

        Row i's first ``chunk_lens[i]`` new slots are real tokens; the rest are
        holes (right padding). Call right before the forward: the bookkeeping
        assumes the forward appends exactly ``width`` slots.
        """
        if len(chunk_lens) != self.rows:
            raise ValueError(f"chunk_lens has {len(chunk_lens)} rows, the cache {self.rows}")
        lens = torch.tensor(list(chunk_lens), dtype=torch.long, device=self.device)
        offsets = torch.arange(width, device=self.device)
        new_valid = offsets[None, :] < lens[:, None]
        starts = torch.tensor(self.lengths, dtype=torch.long, device=self.device)
        # Hole slots repeat the last real position: harmless (masked) and in range.
        last = (lens - 1).clamp(min=0)
        position_ids = starts[:, None] + torch.minimum(offsets[None, :], last[:, None])
        past = self.physical_length
        self.valid = torch.cat([self.valid, new_valid], dim=1)
        self.lengths = [n + c for n, c in zip(self.lengths, chunk_lens, strict=True)]
        if sum(self.lengths) == self.rows * self.physical_length:  # no holes, no device sync
            return ForwardInputs(position_ids, None)
        kv = torch.arange(past + width, device=self.device)
        causal = kv[None, :] <= (past + offsets)[:, None]  # [W, L+W]
        allowed = causal[None, :, :] & self.valid[:, None, :]  # [B, W, L+W]
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        # The finite minimum, not -inf: a slot whose row has no real token yet
        # (a one-token prompt in a prefill batch) then gets a uniform, finite
        # attention instead of NaN, and NaN never enters the cache.
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return ForwardInputs(position_ids, mask[:, None, :, :])

    def rollback(self, keep: Sequence[int], width: int) -> None:
        """Of the last ``width`` slots, row i keeps its first ``keep[i]`` real ones."""
        start = self.physical_length - width
        keep_t = torch.tensor(list(keep), dtype=torch.long, device=self.device)
        offsets = torch.arange(width, device=self.device)
        tail = self.valid[:, start:]
        new_tail = tail & (offsets[None, :] < keep_t[:, None])
        removed = (tail.sum(dim=1) - new_tail.sum(dim=1)).tolist()
        self.valid = torch.cat([self.valid[:, :start], new_tail], dim=1)
        self.lengths = [n - r for n, r in zip(self.lengths, removed, strict=True)]
        self.trim()

    def trim(self) -> None:
        """Crop trailing slots that are holes in every row."""
        if self.physical_length == 0:
            return
        used = self.valid.any(dim=0).nonzero()
        length = int(used[-1].item()) + 1 if used.numel() else 0
        if length < self.physical_length:
            crop_cache(self.cache, length)
            self.valid = self.valid[:, :length]

    def select(self, indices: Sequence[int]) -> None:
        """Keep only the given rows, in the given order."""
        index = torch.tensor(list(indices), dtype=torch.long, device=self.device)
        tensors = cache_tensors(self.cache)
        if not indices:
            self.cache = DynamicCache()
        elif tensors:
            self.cache = cache_from_tensors(
                [(k.index_select(0, index), v.index_select(0, index)) for k, v in tensors]
            )
        self.valid = self.valid.index_select(0, index)
        self.lengths = [self.lengths[i] for i in indices]
        self.trim()
        self.maybe_compact()

    def merge(self, other: RaggedCache) -> None:
        """Append ``other``'s rows below this cache's rows (right-padded with holes)."""
        length = max(self.physical_length, other.physical_length)
        mine, theirs = cache_tensors(self.cache), cache_tensors(other.cache)
        if not mine and not theirs:
            merged: list[tuple[torch.Tensor, torch.Tensor]] = []
        else:
            template = mine or theirs
            mine = mine or _empty_like(template, self.rows)
            theirs = theirs or _empty_like(template, other.rows)
            merged = [
                (
                    torch.cat([_pad_to(k1, length), _pad_to(k2, length)], dim=0),
                    torch.cat([_pad_to(v1, length), _pad_to(v2, length)], dim=0),
                )
                for (k1, v1), (k2, v2) in zip(mine, theirs, strict=True)
            ]
        self.cache = cache_from_tensors(merged) if merged else DynamicCache()
        self.valid = torch.cat([_pad_mask(self.valid, length), _pad_mask(other.valid, length)])
        self.lengths = self.lengths + other.lengths

    def maybe_compact(self) -> bool:
        """Compact when holes pile up; True if it did."""
        holes = self.holes
        if holes < MIN_HOLES or holes < HOLE_SHARE * self.rows * self.physical_length:
            return False
        self.compact()
        return True

    def compact(self) -> None:
        """Move every row's real slots to the front (order kept), dropping holes."""
        length = max(self.lengths, default=0)
        # A stable sort of "is hole" puts real slots first, in their original order.
        order = torch.sort((~self.valid).to(torch.int8), dim=1, stable=True).indices[:, :length]
        tensors = cache_tensors(self.cache)
        if tensors:
            compacted = []
            for keys, values in tensors:
                index = order[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
                compacted.append((keys.gather(2, index), values.gather(2, index)))
            self.cache = cache_from_tensors(compacted)
        self.valid = self.valid.gather(1, order)

    def reset(self) -> None:
        """Drop every slot (the rows stay, with no tokens)."""
        self.cache = DynamicCache()
        self.valid = self.valid[:, :0]
        self.lengths = [0] * self.rows


def _pad_to(tensor: torch.Tensor, length: int) -> torch.Tensor:
    missing = length - tensor.shape[2]
    if missing == 0:
        return tensor
    pad = tensor.new_zeros((tensor.shape[0], tensor.shape[1], missing, tensor.shape[3]))
    return torch.cat([tensor, pad], dim=2)


def _pad_mask(valid: torch.Tensor, length: int) -> torch.Tensor:
    missing = length - valid.shape[1]
    if missing == 0:
        return valid
    return torch.cat([valid, valid.new_zeros((valid.shape[0], missing))], dim=1)


def _empty_like(
    template: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (
            k.new_zeros((rows, k.shape[1], 0, k.shape[3])),
            v.new_zeros((rows, v.shape[1], 0, v.shape[3])),
        )
        for k, v in template
    ]
