"""The one-time rewrites of a model that runs on the CPU, in the order they must run.

The draft is quantized first (``int4-weight`` or ``int8-dynamic``; the
target never is, so the output keeps its distribution), then every fp32
linear left is switched to a prepacked oneDNN weight (``onednn.py``), which
makes a verify of a few tokens cost about one step and gives each row the
same bits whatever the number of rows in the call. Target-only and
speculative engines share the loaded models, so greedy identity compares
like with like.
"""

from __future__ import annotations

from typing import Any

from specpair_runtime.config import Quantization
from specpair_runtime.engine.cpu.int4 import quantize_int4_weights
from specpair_runtime.engine.cpu.int8 import quantize_int8_dynamic
from specpair_runtime.engine.cpu.onednn import use_onednn_linears
from specpair_runtime.engine.loading import CpuKernels


def prepare_cpu_model(
    model: Any,
    quantization: Quantization,
    *,
    kernels: CpuKernels = "onednn",
    keep_plain: bool = False,
) -> Any:
    """Quantize (the draft), then prepack the fp32 linears; returns the model to use.

    ``kernels="default"`` keeps PyTorch's own kernels (the tests that trace a
    step as CUDA runs it); ``keep_plain`` keeps the plain weights beside the
    packed ones, for ``onednn.default_kernel_copy``.
    """
    if quantization == "int8-dynamic":
        model = quantize_int8_dynamic(model)
    elif quantization == "int4-weight":
        quantize_int4_weights(model)
    if kernels == "onednn":
        use_onednn_linears(model, keep_plain=keep_plain)
    return model
