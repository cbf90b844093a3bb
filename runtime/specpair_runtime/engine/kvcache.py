"""Static slot KV storage (gpt-fast style) and the flat ragged batch that writes into it.

Each model owns one tensor, allocated once at start-up::

    storage[layer, 0 = keys | 1 = values, slot, kv_head, position, head_dim]

A request holds one slot for its whole life. A forward over a flat ragged
batch (``[1, total_tokens]``, the varlen layout) writes each token's key and
value at ``(its slot, its position)`` with one in-place ``index_put_`` per
layer, and attention reads ``storage[layer, :, slot, :, :kv_len]`` as a view.
A request's *length* (how many positions hold committed tokens) lives with the
engine; rolling back a rejected draft is just not advancing it, and the stale
positions are overwritten by the next forward. There is no mask over the
cache, no crop, no merge, no compaction, and the storage is never reallocated
(``data_ptr`` and shape stay fixed; ``test_kvcache.py`` checks it).

The last slot (``scratch_slot``) belongs to nobody: padded rows of a bucketed
CUDA-graph step write there.

Why not transformers' ``PagedAttentionCache``: it is built around its own
scheduler and request states, its SDPA path gathers every request's whole KV
into a fresh tensor in each layer and needs a ``[1, 1, T, K]`` mask in the
model's dtype. A slot per request indexed by position gives views instead of
gathers, and a rollback that is only an integer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PretrainedConfig


@dataclass(frozen=True)
class KVGeometry:
    """What one model's KV storage looks like."""

    layers: int
    kv_heads: int
    head_dim: int

    @staticmethod
    def of(config: PretrainedConfig) -> KVGeometry:
        text = config.get_text_config()
        heads = int(text.num_attention_heads)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        head_dim = getattr(text, "head_dim", None) or int(text.hidden_size) // heads
        return KVGeometry(int(text.num_hidden_layers), kv_heads, int(head_dim))

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize


class KVStorage:
    """Preallocated keys and values for ``slots`` requests of up to ``max_length`` tokens."""

    def __init__(
        self,
        geometry: KVGeometry,
        slots: int,
        max_length: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        if slots < 1 or max_length < 1:
            raise ValueError(
                f"KV storage needs slots >= 1 and max_length >= 1, got {slots}, {max_length}"
            )
        self.geometry = geometry
        self.slots = slots
        self.max_length = max_length
        # Zeros, not empty: the dense (CUDA-graph) attention reads whole slots
        # under a mask, and 0 * NaN garbage would still be NaN.
        self.tensor = torch.zeros(
            (geometry.layers, 2, slots + 1, geometry.kv_heads, max_length, geometry.head_dim),
            device=device,
            dtype=dtype,
        )

    @property
    def scratch_slot(self) -> int:
        return self.slots

    def keys(self, layer: int) -> torch.Tensor:
        return self.tensor[layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        return self.tensor[layer, 1]

    def copy_prefix(self, source: int, destination: int, length: int) -> None:
        """Positions [0, length) of slot ``source`` into slot ``destination``, in place."""
        if length > 0:
            self.tensor[:, :, destination, :, :length] = self.tensor[:, :, source, :, :length]


@dataclass
class RowSpan:
    """One request's part of a flat forward: query tokens [start, start + q_len) of the batch."""

    slot: int
    start: int  # offset in the flat batch
    q_len: int
    position: int  # position of the row's first query token (= tokens already in its slot)

    @property
    def kv_len(self) -> int:
        return self.position + self.q_len


@dataclass
class FlatBatch:
    """The metadata of one flat ragged forward (host lists + device index tensors)."""

    rows: list[RowSpan]
    write_slot: torch.Tensor  # [T] long: the slot of every token
    write_position: torch.Tensor  # [T] long: the position of every token
    position_ids: torch.Tensor  # [1, T] long
    masks: list[torch.Tensor | None]  # per row: bool [groups * q_len, kv_len] or None
    dense: DenseRows | None = None  # set when the dense (uniform-rows) attention runs
    slot_groups: list[SlotGroup] = field(default_factory=list)
    solo_rows: list[int] = field(default_factory=list)  # rows attended one by one

    @property
    def total_tokens(self) -> int:
        return int(self.write_slot.shape[0])


@dataclass
class DenseRows:
    """Uniform rows (every row has the same q_len) as tensors, for a capturable step."""

    slot: torch.Tensor  # [R] long
    position: torch.Tensor  # [R] long: first query position of each row
    q_len: int


@dataclass
class SlotGroup:
    """Rows of equal q_len attended in ONE attention call over the slot range [lo, hi].

    One call per layer instead of one per row: on a busy CPU every call is a
    parallel region, and those dominate a step of small models. Keys and
    values are the view ``storage[lo : hi + 1, :, :kv_max]`` (no gather);
    slots in the range that are not in the group get a one-key mask and their
    output is dropped.
    """

    rows: list[int]  # indices into FlatBatch.rows
    lo: int
    hi: int
    q_len: int
    kv_max: int
    tokens: torch.Tensor  # [R * q_len] flat token indices, row by row
    offsets: torch.Tensor  # [R] slot - lo
    mask: torch.Tensor  # bool [hi - lo + 1, 1, q_len, kv_max]
    # The first flat token when the rows fill the slot range in order and sit
    # back to back in the batch (every plain decode step): then the queries are
    # a slice, with no gather or scatter. None otherwise.
    contiguous_start: int | None = None


def _slot_group(rows: list[RowSpan], members: list[int], device: torch.device) -> SlotGroup:
    chosen = [rows[i] for i in members]
    lo = min(r.slot for r in chosen)
    hi = max(r.slot for r in chosen)
    q_len = chosen[0].q_len
    kv_max = max(r.kv_len for r in chosen)
    first = [0] * (hi - lo + 1)  # idle slots in the range see key 0 only
    for row in chosen:
        first[row.slot - lo] = row.position
    seen = torch.tensor(first)[:, None] + torch.arange(q_len)[None, :]
    mask = torch.arange(kv_max)[None, None, :] <= seen[:, :, None]
    tokens = [t for r in chosen for t in range(r.start, r.start + q_len)]
    index = torch.tensor([*tokens, *(r.slot - lo for r in chosen)], dtype=torch.long)
    index = index.to(device, non_blocking=True)
    start = chosen[0].start
    in_order = hi - lo + 1 == len(chosen) and all(
        row.slot == lo + i and row.start == start + i * q_len for i, row in enumerate(chosen)
    )
    return SlotGroup(
        rows=members,
        lo=lo,
        hi=hi,
        q_len=q_len,
        kv_max=kv_max,
        tokens=index[: len(tokens)],
        offsets=index[len(tokens) :],
        mask=mask[:, None].to(device, non_blocking=True),
        contiguous_start=start if in_order else None,
    )


def lower_right_causal(q_len: int, kv_len: int, groups: int, device: torch.device) -> torch.Tensor:
    """Bool mask [groups * q_len, kv_len]: query j sees keys 0 .. kv_len - q_len + j.

    Rows are repeated per query group, matching queries laid out as
    [kv_heads, groups * q_len, head_dim] (grouped-query attention without
    repeating the keys).
    """
    offset = kv_len - q_len
    keys = torch.arange(kv_len, device=device)
    queries = torch.arange(q_len, device=device) + offset
    mask = keys[None, :] <= queries[:, None]
    return mask.repeat(groups, 1) if groups > 1 else mask


def build_flat_batch(
    rows: list[RowSpan], device: torch.device, groups: int, *, dense: bool = False
) -> FlatBatch:
    """Index tensors for ``rows`` (laid out back to back in the flat batch)."""
    slots: list[int] = []
    positions: list[int] = []
    masks: list[torch.Tensor | None] = []
    by_length: dict[int, list[int]] = {}
    for index, row in enumerate(rows):
        by_length.setdefault(row.q_len, []).append(index)
    grouped = set() if dense else {i for m in by_length.values() if len(m) > 1 for i in m}
    for index, row in enumerate(rows):
        slots.extend([row.slot] * row.q_len)
        positions.extend(range(row.position, row.kv_len))
        if row.q_len == 1 or dense or index in grouped:
            masks.append(None)  # one query sees every key; groups and dense build their own
        else:
            masks.append(lower_right_causal(row.q_len, row.kv_len, groups, device))
    # One host-to-device copy for all index vectors.
    packed = torch.tensor([slots, positions], dtype=torch.long).to(device, non_blocking=True)
    dense_rows = None
    if dense:
        q_len = rows[0].q_len
        if any(r.q_len != q_len for r in rows):
            raise ValueError("dense attention needs rows of equal q_len")
        meta = torch.tensor([[r.slot for r in rows], [r.position for r in rows]], dtype=torch.long)
        meta = meta.to(device, non_blocking=True)
        dense_rows = DenseRows(meta[0], meta[1], q_len)
    slot_groups = (
        []
        if dense
        else [
            _slot_group(rows, members, device) for members in by_length.values() if len(members) > 1
        ]
    )
    return FlatBatch(
        rows=rows,
        write_slot=packed[0],
        write_position=packed[1],
        position_ids=packed[1][None, :],
        masks=masks,
        dense=dense_rows,
        slot_groups=slot_groups,
        solo_rows=[i for i in range(len(rows)) if i not in grouped],
    )


BATCH_KEY = "specpair_batch"


class SlotCache:
    """The object handed to a transformers model as its ``cache`` for one forward.

    ``update`` writes this forward's keys and values into the static storage
    and returns the layer's whole storage; the attention function
    (``attention.py``) reads the rows' spans from it. The batch metadata travels
    to the attention function in the model's kwargs, as transformers' own
    paged cache does it.
    """

    is_compileable = True

    def __init__(self, storage: KVStorage, batch: FlatBatch) -> None:
        self.storage = storage
        self.batch = batch

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        kwargs: dict[str, Any] | None = None,
        **_: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # [1, H, T, D] -> [T, H, D], the layout of storage[slot, :, position].
        keys, values = self.write(
            layer_idx, key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)
        )
        if kwargs is not None:
            kwargs[BATCH_KEY] = self.batch
        return keys, values

    def write(
        self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write keys and values [T, H, D] of this forward; returns the layer's storage."""
        keys = self.storage.keys(layer_idx)
        values = self.storage.values(layer_idx)
        index = (self.batch.write_slot, slice(None), self.batch.write_position)
        keys[index] = key_states.to(keys.dtype)
        values[index] = value_states.to(values.dtype)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max((r.kv_len for r in self.batch.rows), default=0)
