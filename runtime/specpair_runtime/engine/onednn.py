"""oneDNN-backed Linear layers for fp32 decoding on the CPU.

Why: a speculative verify pass feeds k+1 tokens through the target. On the
CPU, PyTorch's default MKL sgemm path for a handful of rows costs almost k+1
single-token steps (measured on 2 AVX2 cores, 1536x8960 fp32: 1 row 3-4 ms,
5 rows 14-24 ms), so verification erases the gain. oneDNN's inner-product
kernel on a pre-reordered weight handles few rows far better (1 row 4 ms,
5 rows 9 ms, 8 rows 8.5 ms).

The target is converted for *both* target-only and speculative decoding, so
the two modes run the same kernels and greedy identity holds. Weights are
unchanged (fp32), only their memory layout differs.
"""

from __future__ import annotations

import torch
from torch import nn


class OneDnnLinear(nn.Module):
    """A drop-in for nn.Linear (fp32, CPU) that runs oneDNN's inner product."""

    def __init__(self, dense: nn.Linear) -> None:
        super().__init__()
        self.in_features = dense.in_features
        self.out_features = dense.out_features
        weight = dense.weight.detach()
        # Buffers, not parameters: oneDNN tensors cannot be nn.Parameters.
        self.register_buffer("weight", weight.to_mkldnn(), persistent=False)
        bias = dense.bias.detach() if dense.bias is not None else torch.zeros(self.out_features)
        self.register_buffer("bias", bias.to_mkldnn(), persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        leading = hidden.shape[:-1]
        flat = hidden.reshape(-1, self.in_features).contiguous()
        out = torch._C._nn.mkldnn_linear(flat.to_mkldnn(), self.weight, self.bias).to_dense()
        return out.reshape(*leading, self.out_features)


def onednn_available(model: nn.Module) -> bool:
    """True when the model is fp32 on the CPU and this torch has oneDNN."""
    try:
        param = next(model.parameters())
    except StopIteration:
        return False
    return (
        torch.backends.mkldnn.is_available()
        and param.device.type == "cpu"
        and param.dtype == torch.float32
    )


def convert_linears_to_onednn(model: nn.Module) -> int:
    """Swap every fp32 nn.Linear of a CPU model for OneDnnLinear; return the count.

    Tied weights (an LM head sharing the embedding matrix) are converted into a
    separate copy for the head, since the embedding lookup needs a dense tensor.
    """
    if not onednn_available(model):
        return 0
    swaps: list[tuple[nn.Module, str, nn.Linear]] = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    for parent, name, child in swaps:
        setattr(parent, name, OneDnnLinear(child))
    return len(swaps)
