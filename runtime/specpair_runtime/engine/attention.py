"""Attention over the static slot storage, registered in transformers' AttentionInterface.

Two forms, both reading keys and values from ``KVStorage`` (``kvcache.py``):

- **slot groups**: rows of equal length (every decode row, every verify row of
  a step) share one call over the view ``storage[lo : hi + 1, :, :kv_max]`` of
  their slot range, with a bool mask from positions.
- **varlen** (the other rows): one ``scaled_dot_product_attention`` per request over
  its own span, ``storage[slot, :, :kv_len]`` (a view, no gather). Grouped
  query heads are folded into the query length (``[kv_heads, groups * q, d]``)
  so keys are never repeated. One-token rows need no mask; a verify or a
  prefill chunk gets a bool lower-right causal mask (``groups * q x kv``, for
  that row only, built once per forward and shared by all layers; never in
  the model's dtype, never over the whole batch).
- **dense** (rows of equal length, for CUDA graphs): one batched call over
  ``storage[slots]`` with a bool mask derived from positions, all in tensors,
  so the whole step has static shapes.

``model_attention`` switches a model to this implementation for the duration
of one forward only, so the same model still works with ``generate()``
elsewhere (the HF baselines of the benchmark).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

from specpair_runtime.engine.kvcache import BATCH_KEY, FlatBatch, SlotGroup

IMPLEMENTATION = "specpair_slots"


def slot_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query [1, Hq, T, D]; key/value: the layer's storage [S, Hkv, L, D] -> [1, T, Hq, D]."""
    batch: FlatBatch = kwargs[BATCH_KEY]
    if batch.dense is not None:
        return _dense(query, key, value, batch, scaling), None
    heads, tokens, dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    out = query.new_empty((1, tokens, heads, dim))
    for group in batch.slot_groups:
        _group(query, key, value, group, scaling, out)
    for index in batch.solo_rows:
        row, mask = batch.rows[index], batch.masks[index]
        q = query[0, :, row.start : row.start + row.q_len]  # [Hq, q, D]
        # 4-D, so that the CPU picks its flash kernel (3-D takes the math path: 3-4x slower).
        q = q.reshape(1, kv_heads, groups * row.q_len, dim)
        k = key[row.slot : row.slot + 1, :, : row.kv_len]
        v = value[row.slot : row.slot + 1, :, : row.kv_len]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
        # [1, Hkv, G*q, D] -> [q, Hq, D]
        out[0, row.start : row.start + row.q_len] = o.reshape(heads, row.q_len, dim).transpose(0, 1)
    return out, None


def _group(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: SlotGroup,
    scaling: float | None,
    out: torch.Tensor,
) -> None:
    """Rows of equal length in one call over the view of their slot range."""
    heads, dim = query.shape[1], query.shape[3]
    rows, q_len = len(group.rows), group.q_len
    k = key[group.lo : group.hi + 1, :, : group.kv_max]
    v = value[group.lo : group.hi + 1, :, : group.kv_max]
    gqa = key.shape[1] != heads
    first = group.contiguous_start
    if first is not None:  # rows fill the slot range in order: slices only
        span = slice(first, first + rows * q_len)
        q = query[0, :, span].view(heads, rows, q_len, dim).transpose(0, 1)  # [R, Hq, q, D]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=group.mask, scale=scaling, enable_gqa=gqa
        )
        out[0, span] = o.transpose(1, 2).reshape(rows * q_len, heads, dim)
        return
    picked = query[0].index_select(1, group.tokens)  # [Hq, R*q, D]
    picked = picked.view(heads, rows, q_len, dim).transpose(0, 1)  # [R, Hq, q, D]
    q = query.new_zeros((group.hi - group.lo + 1, heads, q_len, dim))
    q[group.offsets] = picked
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scaling, enable_gqa=gqa)
    o = o.index_select(0, group.offsets).transpose(1, 2).reshape(rows * q_len, heads, dim)
    out[0, group.tokens] = o


def _dense(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    batch: FlatBatch,
    scaling: float | None,
) -> torch.Tensor:
    dense = batch.dense
    assert dense is not None
    heads, tokens, dim = query.shape[1], query.shape[2], query.shape[3]
    q_len = dense.q_len
    rows = tokens // q_len
    q = query[0].reshape(heads, rows, q_len, dim).transpose(0, 1)  # [R, Hq, q, D]
    k = key.index_select(0, dense.slot)  # [R, Hkv, L, D]
    v = value.index_select(0, dense.slot)
    length = k.shape[2]
    seen = dense.position[:, None] + torch.arange(q_len, device=query.device)[None, :]
    mask = torch.arange(length, device=query.device)[None, None, :] <= seen[:, :, None]
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:, None], scale=scaling, enable_gqa=key.shape[1] != heads
    )
    return o.transpose(1, 2).reshape(1, tokens, heads, dim)


AttentionInterface.register(IMPLEMENTATION, slot_attention)


@contextmanager
def model_attention(model: PreTrainedModel) -> Iterator[None]:
    """Run the model's attention through ``slot_attention`` inside the block."""
    config = model.config
    previous = config._attn_implementation
    if previous == IMPLEMENTATION:  # nested (a captured step): nothing to switch or restore
        yield
        return
    config._attn_implementation = IMPLEMENTATION
    try:
        yield
    finally:
        config._attn_implementation = previous
