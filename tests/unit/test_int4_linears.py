"""Weight-only int4 linears for the draft: group quantization, both kernel paths, the swap."""

from __future__ import annotations

import pytest
import torch

from specpair_runtime.engine.cpu import int4 as int4_linears
from specpair_runtime.engine.cpu.int4 import (
    GROUP_SIZE,
    INT4_MAX_ROWS,
    Int4Linear,
    can_quantize,
    dequantize_groups,
    quantize_groups,
    quantize_int4_weights,
)


def test_group_quantization_is_within_half_a_level_and_uses_all_sixteen() -> None:
    torch.manual_seed(0)
    weight = torch.randn(32, 4 * GROUP_SIZE)
    codes, scale, zero = quantize_groups(weight)
    assert codes.dtype == torch.int32 and codes.shape == weight.shape
    assert scale.shape == zero.shape == (32, 4)
    assert int(codes.min()) == 0 and int(codes.max()) == 15  # min and max of each group
    restored = dequantize_groups(codes, scale, zero)
    per_element_scale = scale.repeat_interleave(GROUP_SIZE, dim=1)
    assert torch.all((restored - weight).abs() <= per_element_scale / 2 + 1e-6)


def test_a_constant_group_survives() -> None:
    # max == min: the scale must not be zero (a division by it would give NaN).
    weight = torch.full((16, GROUP_SIZE), 0.25)
    codes, scale, zero = quantize_groups(weight)
    assert torch.isfinite(scale).all()
    assert torch.allclose(dequantize_groups(codes, scale, zero), weight)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 2, INT4_MAX_ROWS, INT4_MAX_ROWS + 1, 33])
def test_both_kernel_paths_compute_the_quantized_weight(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    linear = torch.nn.Linear(2 * GROUP_SIZE, 48, bias=bias)
    layer = Int4Linear(linear)
    codes, scale, zero = quantize_groups(linear.weight)
    expected_weight = dequantize_groups(codes, scale, zero)
    x = torch.randn(rows, 2 * GROUP_SIZE)
    with torch.inference_mode():
        got = layer(x[None])  # [1, rows, K], as a model calls it
        expected = torch.nn.functional.linear(x, expected_weight, linear.bias)
    assert got.shape == (1, rows, 48) and got.dtype == torch.float32
    # The activations run in bf16 (8 bits of mantissa).
    assert torch.allclose(got[0], expected, atol=0.03, rtol=0.02)


def test_without_a_native_bf16_gemm_every_call_takes_the_int4_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(int4_linears, "native_bf16_gemm", lambda: False)
    torch.manual_seed(1)
    linear = torch.nn.Linear(GROUP_SIZE, 16)
    layer = Int4Linear(linear)
    assert layer.gemm_weight is None
    x = torch.randn(3, 9, GROUP_SIZE)  # 27 rows
    codes, scale, zero = quantize_groups(linear.weight)
    with torch.inference_mode():
        expected = torch.nn.functional.linear(x, dequantize_groups(codes, scale, zero), linear.bias)
        assert torch.allclose(layer(x), expected, atol=0.03, rtol=0.02)


def test_shapes_the_kernel_cannot_take_are_kept() -> None:
    assert can_quantize(torch.empty(16, GROUP_SIZE))
    assert not can_quantize(torch.empty(16, GROUP_SIZE + 8))  # K not a multiple of the group
    assert not can_quantize(torch.empty(20, GROUP_SIZE))  # N not a multiple of 16
    model = torch.nn.Sequential(
        torch.nn.Linear(GROUP_SIZE, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 20),  # kept
        torch.nn.Linear(20, 32).to(torch.bfloat16),  # not fp32: kept
    )
    assert quantize_int4_weights(model) == 1
    assert isinstance(model[0], Int4Linear)
    assert type(model[2]) is torch.nn.Linear and type(model[3]) is torch.nn.Linear
    with torch.inference_mode():
        assert model[:3](torch.randn(2, GROUP_SIZE)).shape == (2, 20)
