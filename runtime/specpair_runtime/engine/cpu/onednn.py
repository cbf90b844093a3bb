"""Prepacked oneDNN linears for fp32 on the CPU: a verify costs about one step, batch-invariant.

A speculative verify multiplies every weight matrix by k+1 rows instead of
one. On the CPU that is memory-bound like a 1-token step only if the kernel
does not pay per call for the extra rows. Measured on 2 cores (Xeon, AVX-512),
one 1536 -> 8960 fp32 layer, milliseconds for 1 / 2 / 5 / 8 rows:

- stock ``F.linear`` (MKL):                      1.1 / - / 2.1 / 3.0
- oneDNN ``_linear_pointwise``, plain weight:    1.1 / 1.6 / 1.8 / 2.0
- oneDNN with the weight prepacked once
  (``_reorder_linear_weight``, this module):     1.1 / 1.2 / 1.1 / 1.4

Batch invariance matters as much: greedy speculative output must equal greedy
target-only output token for token on the CPU, so a row's result must not
depend on how many rows share the call. oneDNN's GEMM gives every row the
same bits for 2 rows or 33, but one row alone takes a matrix-vector path that
rounds differently (seen on 1536 x 8960 and 8960 x 1536, not on every shape).
So every call takes the GEMM path with at least ``MIN_GEMM_ROWS`` rows: a
call with fewer is padded with zero rows. That costs nothing on a
prepacked weight, and on some CPUs 2 or 3 rows run slower than 4. On 2 AMD
EPYC vCPUs (AVX-512), milliseconds for 1 / 2 / 3 / 4 / 5 / 8 rows:

- 1536 -> 8960:  3.24 / 3.08 / 2.81 / 2.49 / 2.51 / 3.21
- 8960 -> 1536:  3.08 / 2.93 / 2.71 / 2.47 / 2.36 / 3.10

Run as two rows, a 1-token forward of the 1.5B target took 346-410 ms
there, more than its 4-token verify (320-333 ms); padded to four, 305-311 ms
(``bench_forward.py``).

``use_onednn_linears`` switches every fp32 ``nn.Linear`` of a model in place,
once, at load (``engine/cpu/prepare.py``). The packed copy is opaque, so the
plain weight stays where the model needs it: tied to the input embeddings, or
kept on request (``keep_plain``); otherwise it is released, so the model does
not hold its weights twice. ``default_kernel_copy`` gives a model that kept
its plain weights a twin on PyTorch's default kernels that shares every
tensor (the benchmark's stock-kernel baseline). Results differ from MKL's by
float rounding only (about 1e-6).
"""

from __future__ import annotations

import copy
import logging
import types

import torch

log = logging.getLogger(__name__)

# Calls with fewer rows are padded to this many (see above): at least two keeps
# every call off the matrix-vector path, four is the fastest small shape measured.
MIN_GEMM_ROWS = 4

_MARK = "_specpair_onednn"
_PACKED = "_specpair_packed"
_PLAIN_RELEASED = "_specpair_plain_released"


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return out


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    packed = getattr(self, _PACKED)
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return torch.nn.functional.linear(x, self.weight, self.bias)
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    if count >= MIN_GEMM_ROWS:
        return _linear(rows, packed, self.bias).reshape(*x.shape[:-1], -1)
    # One row alone would take oneDNN's matrix-vector path (other rounding), and
    # a few rows run slower than four on some CPUs: pad with zero rows.
    padded = torch.nn.functional.pad(rows, (0, 0, 0, MIN_GEMM_ROWS - count))
    return _linear(padded, packed, self.bias)[:count].reshape(*x.shape[:-1], -1)


def onednn_available() -> bool:
    """True when this torch build can run the prepacked oneDNN linear (checked on a tiny input)."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    try:
        x = torch.ones((2, 4))
        w = torch.ones((3, 4))
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(w)
            y = _linear(x, packed, None)
        return bool(torch.allclose(y, torch.full((2, 3), 4.0)))
    except (RuntimeError, AttributeError):
        return False


def _shared_weights(model: torch.nn.Module) -> set[int]:
    """data_ptrs of weights that something other than one Linear reads (tied embeddings)."""
    shared: set[int] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            shared.add(module.weight.data_ptr())
    return shared


def use_onednn_linears(model: torch.nn.Module, *, keep_plain: bool = False) -> int:
    """Route the model's fp32 CPU ``nn.Linear`` layers through prepacked oneDNN; returns how many.

    Quantized or non-fp32 layers, and layers on other devices, are left alone.
    Applying it twice is harmless. Without ``keep_plain`` the plain weight of
    an untied layer is released (the packed copy replaces it).
    """
    if not onednn_available():
        log.info("oneDNN linear is not available; keeping the default CPU kernels")
        return 0
    shared = _shared_weights(model)
    count = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or getattr(module, _MARK, False):
            continue
        weight = module.weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            continue
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        setattr(module, _PACKED, packed)
        if not keep_plain and weight.data_ptr() not in shared:
            # An empty placeholder keeps dtype and device for code that asks the model.
            module.weight = torch.nn.Parameter(weight.new_empty((0,)), requires_grad=False)
            setattr(module, _PLAIN_RELEASED, True)
        module.forward = types.MethodType(_packed_forward, module)  # type: ignore[method-assign]
        setattr(module, _MARK, True)
        count += 1
    return count


def default_kernel_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A twin of ``model`` whose linears run PyTorch's default kernels; every tensor is shared.

    Raises ValueError when a switched layer's plain weight was released
    (switch with ``keep_plain=True`` to keep a way back).
    """
    switched = [m for m in model.modules() if getattr(m, _MARK, False)]
    if any(getattr(m, _PLAIN_RELEASED, False) for m in switched):
        raise ValueError(
            "the plain weights were released when the linears were packed; "
            "use_onednn_linears(model, keep_plain=True) keeps them for the default kernels"
        )
    shared: dict[int, object] = {}
    for module in model.modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        shared.update((id(t), t) for t in tensors)
    twin: torch.nn.Module = copy.deepcopy(model, memo=shared)
    for module in twin.modules():
        if getattr(module, _MARK, False):
            del module.forward
            delattr(module, _MARK)
            delattr(module, _PACKED)
    return twin
