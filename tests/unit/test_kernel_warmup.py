"""Kernel warm-up: one layer of each packed shape runs every row bucket, the head only its own."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from specpair_runtime.engine.cpu_kernels import gemm_rows, onednn_available, use_onednn_linears
from specpair_runtime.engine.int4_linears import INT4_MAX_ROWS, Int4Linear, native_bf16_gemm
from specpair_runtime.engine.kernel_warmup import row_buckets, warm_up_row_buckets

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch build without oneDNN")


class TinyLM(torch.nn.Module):
    """Two blocks of equal shape and an output head, as a decoder's linears are laid out."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)) for _ in range(2)
        )
        self.head: torch.nn.Module = torch.nn.Linear(32, 96, bias=False)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head


def rows_seen(model: torch.nn.Module) -> dict[str, list[int]]:
    """Record the row count of every call, per layer name."""
    seen: dict[str, list[int]] = defaultdict(list)
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, Int4Linear)):
            module.register_forward_pre_hook(
                lambda _m, args, name=name: seen[name].append(args[0].shape[0])
            )
    return seen


def test_row_buckets_cover_every_count_once() -> None:
    buckets = row_buckets(40)
    assert buckets == sorted(set(buckets)) and buckets[0] == 2 and buckets[-1] == 40
    assert {gemm_rows(n) for n in range(1, 41)} == set(buckets)
    with pytest.raises(ValueError, match="limit must be >= 1"):
        row_buckets(0)


def test_one_layer_per_shape_runs_every_bucket_and_the_head_its_own_limit() -> None:
    model = TinyLM()
    assert use_onednn_linears(model) == 5
    seen = rows_seen(model)
    calls = warm_up_row_buckets(model, body_rows=40, head_rows=10)
    body, head = row_buckets(40), row_buckets(10)
    assert seen["blocks.0.0"] == body and seen["blocks.0.1"] == body
    assert "blocks.1.0" not in seen and "blocks.1.1" not in seen  # same shapes: built already
    assert seen["head"] == head
    assert calls == 2 * len(body) + len(head)


def test_layers_left_on_the_default_kernels_are_not_warmed() -> None:
    model = TinyLM()  # not switched to oneDNN: nothing to build
    seen = rows_seen(model)
    assert warm_up_row_buckets(model, body_rows=40, head_rows=10) == 0
    assert not seen


@pytest.mark.skipif(not native_bf16_gemm(), reason="no native bf16 GEMM on this CPU")
def test_int4_layers_warm_only_the_counts_that_take_the_bf16_gemm() -> None:
    model = TinyLM()
    model.head = Int4Linear(torch.nn.Linear(32, 96, bias=False))
    seen = rows_seen(model)
    warm_up_row_buckets(model, body_rows=8, head_rows=12)
    assert seen["head"] == [n for n in row_buckets(12) if n > INT4_MAX_ROWS]
