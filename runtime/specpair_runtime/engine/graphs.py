"""CUDA graphs for uniform decode and verify steps.

A decode step (1 token per row) or a verify step (k+1 tokens per row, one
depth for the step) has rows of equal length. Padded to a bucket of rows
(1, 2, 4, 8, ...), such a step has static shapes: the input ids, the rows'
slots and positions are tensors, attention is the dense form of
``attention.py`` (a mask derived from positions over whole slots), and KV
writes land in the fixed storage. So one graph per (bucket, tokens per row)
is recorded and replayed. Padded rows write into the storage's scratch slot.

Two ways to record (``GraphStep(compile=...)``):

- **capture** (the default): the eager step, recorded with
  ``torch.cuda.CUDAGraph`` into static input buffers, as SGLang does by
  default. Recording a shape costs a few forwards, so the warm-up takes
  seconds; the replay removes the launch overhead of the layer loop, which is
  what bounds a small model's step on a GPU.
- **compile**: ``torch.compile(mode="reduce-overhead")`` (inductor's fused
  kernels, recorded by cudagraph trees; ``DYNAMIC_SHAPES``: a few compiles
  serve every shape). Each compile of the 1.5B target took 48-71 s on an
  H200, so the warm-up takes minutes.

Prefill chunks (ragged lengths) run eagerly through the varlen attention;
a chunk of rows of one length up to ``MAX_GRAPH_TOKENS_PER_ROW`` is uniform
and takes the graph path too.

``warm_up`` records every shape before the first request, so no request
waits for a capture or a compile.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from specpair_runtime.engine.attention import model_attention
from specpair_runtime.engine.kvcache import DenseRows, FlatBatch, KVStorage, RowSpan, SlotCache


class GraphModel(Protocol):
    """What a graph step needs of its model's runner (``runner.ModelRunner``)."""

    model: Any
    device: torch.device
    slots: int
    embedding_rows: int
    head: Any

    def allocate(self) -> KVStorage: ...

    def hidden_states(self, input_ids: torch.Tensor, cache: SlotCache) -> torch.Tensor: ...


MAX_GRAPH_TOKENS_PER_ROW = 17  # verify of depth 16 (the knob's maximum) + 1
# torch.compile's automatic dynamic shapes: the first shape compiles static, the
# next one recompiles with symbolic sizes that serve the later shapes (sizes of 1
# stay specialized, so a few compiles in all), and cudagraph trees record one
# graph per concrete shape (cheap next to a compile).
# ``dynamic=False`` would compile each (bucket, tokens per row) shape alone.
DYNAMIC_SHAPES: bool | None = None


def row_bucket(rows: int) -> int:
    """The next power of two at or above ``rows``."""
    return 1 << max(rows - 1, 0).bit_length()


def row_buckets(slots: int) -> list[int]:
    """Every row bucket that a step over at most ``slots`` rows can take: 1, 2, 4, ..."""
    return [1 << power for power in range(row_bucket(slots).bit_length())]


def step_shapes(slots: int) -> list[tuple[int, int]]:
    """Every (row bucket, tokens per row) shape of one model's graph steps."""
    tokens = range(1, MAX_GRAPH_TOKENS_PER_ROW + 1)
    return [(bucket, q_len) for bucket in row_buckets(slots) for q_len in tokens]


def graph_shapes(slots: int) -> int:
    """How many (row bucket, tokens per row) shapes one model's steps can take."""
    return len(step_shapes(slots))


# cudagraph trees run a new shape once uncaptured (warm-up) and record it on the
# next call; later calls replay.
CAPTURE_CALLS = 2


_reserved_entries = 0  # compiled shapes that this process's GraphSteps may need


def reserve_compile_entries(count: int) -> None:
    """Raise dynamo's recompile limits so that ``count`` more compiled shapes fit.

    Dynamo keeps compiled code per code object, and every GraphStep (both
    models, every engine of the process) shares ``_forward``'s. Past
    ``recompile_limit`` (8 by default) a new shape would silently run
    eagerly, without a captured graph; a step can take up to
    ``graph_shapes(slots)`` shapes per model.
    """
    import torch._inductor.config as inductor

    global _reserved_entries
    _reserved_entries += count
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, _reserved_entries)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, _reserved_entries)
    # One recorded graph per shape is the plan here, not a surprise to warn about.
    warn_at = inductor.triton.cudagraph_dynamic_shape_warn_limit
    if warn_at is not None:
        inductor.triton.cudagraph_dynamic_shape_warn_limit = max(warn_at, _reserved_entries)


Body = Callable[[], None]


class CudaGraphRecorder:
    """Records step bodies as CUDA graphs that share one memory pool; returns their replay.

    The body runs once eagerly first, on a side stream as PyTorch asks, so
    that lazy initialisation (cuBLAS handles, workspaces, the output buffer)
    happens outside the capture. ``capture_error_mode="thread_local"``:
    another thread's CUDA calls (the memory probe) do not abort a capture.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool: torch.cuda._POOL_HANDLE | None = None

    def __call__(self, body: Body) -> Body:
        side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            body()
        return graph.replay


@dataclass(frozen=True)
class _Recorded:
    """One captured shape: its replay, the static inputs it reads, the logits it writes."""

    replay: Body
    ids: torch.Tensor  # [bucket * q_len]
    meta: torch.Tensor  # [2, bucket]: slots, then first positions
    logits: torch.Tensor  # [bucket * q_len, vocab]: the shared output buffer's first rows


class GraphStep:
    """Runs uniform steps of one model as recorded CUDA graphs.

    ``compile``: record ``torch.compile(mode="reduce-overhead")``'s fused step
    (minutes of compiles) instead of capturing the eager step (seconds).
    """

    def __init__(self, runner: GraphModel, *, compile: bool = False) -> None:
        self.runner = runner
        self.compiles = compile
        self._recorded: dict[tuple[int, int], _Recorded] = {}
        self.recorder: Callable[[Body], Body] = CudaGraphRecorder(runner.device)
        self._output: torch.Tensor | None = None  # the logits that every graph writes
        if compile:
            reserve_compile_entries(graph_shapes(runner.slots))
            self._compiled = torch.compile(
                self._forward, mode="reduce-overhead", dynamic=DYNAMIC_SHAPES
            )

    @property
    def recorded(self) -> int:
        """How many shapes this step has captured (capture mode; compile mode records its own)."""
        return len(self._recorded)

    def accepts(self, rows: list[RowSpan], sample_index: torch.Tensor | None) -> bool:
        if not rows or sample_index is None:
            return False
        q_len = rows[0].q_len
        return q_len <= MAX_GRAPH_TOKENS_PER_ROW and all(r.q_len == q_len for r in rows)

    def _forward(
        self, ids: torch.Tensor, slot: torch.Tensor, position: torch.Tensor, q_len: int
    ) -> torch.Tensor:
        storage = self.runner.allocate()
        offsets = torch.arange(q_len, device=ids.device)
        write_position = (position[:, None] + offsets[None, :]).flatten()
        batch = FlatBatch(
            rows=[],
            # expand, not repeat_interleave: no size computed on the host during capture.
            write_slot=slot[:, None].expand(-1, q_len).flatten(),
            write_position=write_position,
            position_ids=write_position[None, :],
            masks=[],
            dense=DenseRows(slot, position, q_len),
        )
        # As the eager path: a draft with fewer embedding rows still reads every committed id.
        ids = ids.clamp(max=self.runner.embedding_rows - 1)
        hidden = self.runner.hidden_states(ids[None, :], SlotCache(storage, batch))
        logits: torch.Tensor = self.runner.head(hidden[0])
        return logits

    def __call__(
        self, rows: list[RowSpan], input_ids: torch.Tensor, sample_index: torch.Tensor
    ) -> torch.Tensor:
        scratch = self.runner.allocate().scratch_slot
        q_len = rows[0].q_len
        padding = row_bucket(len(rows)) - len(rows)
        slots = [r.slot for r in rows] + [scratch] * padding
        positions = [r.position for r in rows] + [0] * padding
        ids = torch.cat([input_ids, input_ids.new_zeros(padding * q_len)])
        logits = self._run(ids, slots, positions, q_len)
        # Padded rows sit after the real ones, so the flat indices are unchanged;
        # index_select copies out of the graph's reused output buffer.
        return logits.index_select(0, sample_index)

    def warm_up(self) -> int:
        """Record every step shape now; returns how many shapes.

        Every row is a padded one (the scratch slot at position 0), so no
        request's KV is touched. Largest first: the smaller graphs then reuse
        the pool's memory.
        """
        scratch = self.runner.allocate().scratch_slot
        shapes = step_shapes(self.runner.slots)
        for bucket, q_len in reversed(shapes):
            ids = torch.zeros(bucket * q_len, dtype=torch.long, device=self.runner.device)
            for _ in range(CAPTURE_CALLS if self.compiles else 1):
                self._run(ids, [scratch] * bucket, [0] * bucket, q_len)
        return len(shapes)

    def _run(
        self, ids: torch.Tensor, slots: list[int], positions: list[int], q_len: int
    ) -> torch.Tensor:
        meta = torch.tensor([slots, positions], dtype=torch.long)
        if not self.compiles:
            recorded = self._recorded.get((len(slots), q_len))
            if recorded is None:
                recorded = self._capture(ids, meta, q_len)
            recorded.ids.copy_(ids)
            recorded.meta.copy_(meta)
            recorded.replay()
            return recorded.logits
        # The step writes KV into the storage in place. CUDA graph trees capture a
        # graph only when every input it mutates keeps its address (parameters, or
        # tensors marked so); unmarked, they would skip capture and run it uncaptured.
        torch._dynamo.mark_static_address(self.runner.allocate().tensor)
        meta = meta.to(self.runner.device)
        with model_attention(self.runner.model):
            logits: torch.Tensor = self._compiled(ids, meta[0], meta[1], q_len)
        return logits

    def _capture(self, ids: torch.Tensor, meta: torch.Tensor, q_len: int) -> _Recorded:
        """Record the eager step of this shape over static input buffers.

        The step copies its logits into the model's one output buffer and
        frees its own, so the pool that all of the model's graphs share holds
        one graph's intermediates rather than every shape's logits (8 slots x
        17 tokens of a 152k vocabulary in bf16: 0.7 GB per model, summed over
        the 68 shapes). Graphs replay one at a time, and a step copies its
        rows out of the buffer before the next replay.
        """
        static_ids = ids.clone()
        static_meta = meta.to(self.runner.device)

        def body() -> None:
            with model_attention(self.runner.model):
                logits = self._forward(static_ids, static_meta[0], static_meta[1], q_len)
            # Allocated on the eager run before the capture; the capture only writes it.
            self._output_buffer(logits)[: logits.shape[0]].copy_(logits)

        replay = self.recorder(body)
        assert self._output is not None
        rows = static_ids.shape[0]
        recorded = _Recorded(replay, static_ids, static_meta, self._output[:rows])
        self._recorded[(int(meta.shape[1]), q_len)] = recorded
        return recorded

    def _output_buffer(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits buffer of all of this model's graphs, rows for the largest shape."""
        rows = row_bucket(self.runner.slots) * MAX_GRAPH_TOKENS_PER_ROW
        shape = (rows, logits.shape[1])
        if (
            self._output is None
            or self._output.shape != shape
            or self._output.dtype != logits.dtype
        ):
            self._output = logits.new_empty(shape)
        return self._output
