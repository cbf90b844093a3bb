"""Weight-only int4 linears for the draft on the CPU (``quantization: int4-weight``).

The draft only proposes tokens, so its weights may be approximate; what
matters is how often the target accepts them and what a forward costs.
Measured on the Qwen2.5-Coder 0.5B draft against its 1.5B target (2 vCPUs,
AVX-512 with BF16; ``bench/bench_draft_agreement.py``), top-1 agreement with
the target's greedy token on the three ``make bench`` prompts, 64 tokens
read one at a time as a draft decodes (in one forward with ``--one-forward``):

- fp32 draft:                               0.73 / 0.83 / 0.95
- int4 weights, groups of 32, bf16 inputs:  0.70 / 0.77 / 0.94 (the same)
- int8-dynamic (int8 activations too):      0.67 / 0.73 / 0.91 (0.58 / 0.52 / 0.88)

Dynamic int8 quantizes the activations of a call with one scale, and Qwen's
activations have outlier channels, so the more rows share a call, the more
it loses. Weight-only int4 keeps the activations in bf16 (the GGUF files of
the demo pair are 4-bit already). In one microbenchmark (4864 x 896),
``torch.ops.aten._weight_int4pack_mm_for_cpu`` took about 140-190 us for one
row, against 145-220 us for int8, but it costs about one matrix-vector
product per row: 5 rows took 530 us where the oneDNN bf16 GEMM took 335 us,
and 128 rows 6.9 ms against 0.8 ms. So a call with more
than ``INT4_MAX_ROWS`` rows (a prefill chunk, a batch of streams) runs the
same int4 weights dequantized once into a prepacked oneDNN bf16 weight, on
CPUs where oneDNN runs bf16 natively (AVX-512 BF16, AMX). Elsewhere every
call takes the int4 kernel, and no dense copy is held. On an AVX2-only AMD
EPYC (2 vCPUs, 4864 x 896) the kernel took 0.4-0.6 ms for one row and
6.4-7.9 ms for 32 rows, against 5.1 ms for the fp32 prepacked oneDNN GEMM:
prompt chunks cost more there, decoding much less, and the int4 draft still
won (``config.recommended_draft_quantization``). The kernel also takes fp32
activations, but there it was 13-28x slower than with bf16 ones.

Codes are asymmetric per group of ``GROUP_SIZE`` input channels, in the
layout the kernel wants: ``w = (code - 8) * scale + zero``.
"""

from __future__ import annotations

import logging

import torch

from specpair_runtime.hardware import native_bf16_gemm

log = logging.getLogger(__name__)

GROUP_SIZE = 32
INT4_MAX_ROWS = 4  # above this many rows the dequantized GEMM is faster (see above)
_INNER_TILES = 1  # innerKTiles argument of the CPU packing op


def can_quantize(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> bool:
    """True when ``weight`` [N, K] has the shape the int4 kernel takes."""
    out_features, in_features = weight.shape
    return in_features % group_size == 0 and out_features % 16 == 0


def quantize_groups(
    weight: torch.Tensor, group_size: int = GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4 codes [N, K] (int32, 0..15), scales and zeros [N, K / group] of ``weight``.

    Each group of ``group_size`` input channels maps its min..max onto 16 levels.
    """
    out_features, in_features = weight.shape
    groups = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    low = groups.amin(dim=-1, keepdim=True)
    high = groups.amax(dim=-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    codes = ((groups - low) / scale).round().clamp(0, 15).to(torch.int32)
    zero = low + 8 * scale  # the kernel computes (code - 8) * scale + zero
    return codes.reshape(out_features, in_features), scale[..., 0], zero[..., 0]


def dequantize_groups(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int = GROUP_SIZE
) -> torch.Tensor:
    """The float32 weight [N, K] that the codes stand for."""
    out_features, in_features = codes.shape
    grouped = codes.reshape(out_features, in_features // group_size, group_size).float()
    return ((grouped - 8) * scale[..., None] + zero[..., None]).reshape(out_features, in_features)


class Int4Linear(torch.nn.Module):
    """A Linear with int4 group-quantized weights; float32 in, float32 out."""

    def __init__(self, linear: torch.nn.Linear, group_size: int = GROUP_SIZE) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.group_size = group_size
        codes, scale, zero = quantize_groups(linear.weight, group_size)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, _INNER_TILES)
        # [K / group, N, 2]: what the kernel reads, in the activations' dtype.
        pairs = torch.stack([scale, zero], dim=-1).transpose(0, 1)
        self.scales_and_zeros = pairs.to(torch.bfloat16).contiguous()
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        # The same int4 weights for calls of many rows, dequantized and prepacked once.
        self.gemm_weight: torch.Tensor | None = None
        if native_bf16_gemm():
            dense = dequantize_groups(codes, scale, zero, group_size).to(torch.bfloat16)
            self.gemm_weight = torch.ops.mkldnn._reorder_linear_weight(dense)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out: torch.Tensor
        if self.gemm_weight is None or rows.shape[0] <= INT4_MAX_ROWS:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows, self.packed, self.group_size, self.scales_and_zeros
            )
        else:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.gemm_weight, None, "none", [], "")
        out = out.float()
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}, bf16_gemm={self.gemm_weight is not None}"
        )


def quantize_int4_weights(model: torch.nn.Module) -> int:
    """Replace the model's fp32 CPU ``nn.Linear`` layers by ``Int4Linear``; returns how many.

    Layers whose shape the kernel cannot take stay as they are. Tied input
    embeddings keep their float weight (a lookup reads one row per token).
    """
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            weight = child.weight
            if weight.dtype != torch.float32 or weight.device.type != "cpu":
                continue
            if not can_quantize(weight):
                shape = tuple(weight.shape)
                log.info("keeping %s %s unquantized: the int4 kernel cannot pack it", name, shape)
                continue
            with torch.no_grad():
                setattr(parent, name, Int4Linear(child))
            count += 1
    return count
