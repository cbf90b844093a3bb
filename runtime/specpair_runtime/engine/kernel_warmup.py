"""Build oneDNN's CPU primitives for every row bucket before the first request.

oneDNN builds a primitive the first time it meets a (weight shape, row count),
about 0.5-1.5 ms per layer shape (``cpu_kernels.py``). A server meets the row
counts one by one under load, so the first steps of every new count stall all
the running streams. Warming one layer of each distinct shape per bucket
builds them all: layers of one shape share a primitive, so a model of 28
layers costs what one layer does.
"""

from __future__ import annotations

import torch

from specpair_runtime.engine.cpu_kernels import gemm_rows, is_packed
from specpair_runtime.engine.int4_linears import INT4_MAX_ROWS, Int4Linear


def row_buckets(limit: int) -> list[int]:
    """The distinct ``gemm_rows`` of calls of 1..``limit`` rows, ascending."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    return sorted({gemm_rows(rows) for rows in range(1, limit + 1)})


def _packed_layer(module: torch.nn.Module) -> tuple[tuple[object, ...], int, int] | None:
    """(what oneDNN's primitive depends on, input width, fewest rows that take the GEMM)
    for a layer that runs a packed GEMM; None for any other module."""
    if isinstance(module, Int4Linear):
        if module.gemm_weight is None:
            return None  # every call takes the int4 kernel: nothing to build
        return (
            ("int4", module.in_features, module.out_features),
            module.in_features,
            INT4_MAX_ROWS + 1,
        )
    if isinstance(module, torch.nn.Linear) and is_packed(module):
        key: tuple[object, ...] = (
            "fp32",
            module.in_features,
            module.out_features,
            module.bias is not None,
        )
        return key, module.in_features, 1
    return None


def warm_up_row_buckets(model: torch.nn.Module, body_rows: int, head_rows: int) -> int:
    """Run one layer of each packed shape on every bucket up to ``body_rows`` rows
    (``head_rows`` for the output head, which sees only the sampled positions);
    returns how many calls it made."""
    output_embeddings = getattr(model, "get_output_embeddings", None)
    head = output_embeddings() if callable(output_embeddings) else None
    seen: set[tuple[object, ...]] = set()
    calls = 0
    with torch.inference_mode():
        for module in model.modules():
            layer = _packed_layer(module)
            if layer is None:
                continue
            shape, width, smallest = layer
            key = (*shape, module is head)
            if key in seen:
                continue
            seen.add(key)
            for rows in row_buckets(head_rows if module is head else body_rows):
                if rows >= smallest:
                    module(torch.zeros(rows, width))
                    calls += 1
    return calls
