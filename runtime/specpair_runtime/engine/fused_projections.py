"""One GEMM for q/k/v and one for gate/up: fused projections, as vLLM and gpt-fast lay them out.

A decoder layer of the Llama family multiplies the same normed hidden state
by three attention projections and by two MLP projections. Concatenating
their weights along the output features turns five GEMM calls into two. Each
output column still comes from its own weight row, so the results are the
same bits as the separate calls (``test_fused_projections.py`` checks it on
the oneDNN and int4 paths); only the per-call overhead goes, which on a
2-core CPU is most of what a small draft's narrow k and v projections cost.

``fuse_projections`` runs once, at load time, before the draft is quantized
and before the target's linears are prepacked, so those steps see one plain
``nn.Linear`` (``qkv_proj``, ``gate_up_proj``) and the model never holds a
weight twice. The old attribute names stay, as ``ProjectionSlice`` modules:
transformers' own modeling code (``generate``, the golden check, the HF
baselines of the benchmark) still calls ``q_proj(x)``, ``k_proj(x)`` and
``v_proj(x)`` on one hidden state, and the first of those calls runs the fused
GEMM while the others take their columns of its result. The engine's own
decoder loop (``decoder.py``) calls the fused modules directly.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj")
MLP_PARTS = ("gate_proj", "up_proj")
FUSED_ATTENTION = "qkv_proj"
FUSED_MLP = "gate_up_proj"
PARTS = {FUSED_ATTENTION: ATTENTION_PARTS, FUSED_MLP: MLP_PARTS}  # fused name -> parts


class _SharedCall:
    """The fused module's output for the last input, until every part has taken its columns.

    transformers calls the parts one after another on the same tensor, so the
    first call runs the GEMM and the rest slice its result. The result is
    dropped once every part has been served, so a long prompt chunk's
    activations are not held between layers. The state is one tuple, read and
    replaced whole, so forwards on two threads at worst recompute.
    """

    def __init__(self, owner: torch.nn.Module, fused_name: str, sizes: list[int]) -> None:
        self.owner = owner  # looked up per call: quantization may swap the fused module
        self.fused_name = fused_name
        self.bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        # (input, fused output, parts not yet served), or None.
        self.state: tuple[torch.Tensor, torch.Tensor, frozenset[int]] | None = None

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor:
        state = self.state
        if state is not None and state[0] is x and index in state[2]:
            output, unserved = state[1], state[2]
        else:
            fused: torch.nn.Module = getattr(self.owner, self.fused_name)
            output, unserved = fused(x), frozenset(range(len(self.bounds) - 1))
        unserved = unserved - {index}
        self.state = (x, output, unserved) if unserved else None
        return output[..., self.bounds[index] : self.bounds[index + 1]]


class ProjectionSlice(torch.nn.Module):
    """Stands where ``q_proj`` (or ``k_proj``, ...) was: its columns of the fused projection."""

    def __init__(self, shared: _SharedCall, index: int, in_features: int) -> None:
        super().__init__()
        # Kept out of the module tree: the fused Linear is the owner's child already.
        self.__dict__["_shared"] = shared
        self.index = index
        self.in_features = in_features
        self.out_features = shared.bounds[index + 1] - shared.bounds[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared: _SharedCall = self.__dict__["_shared"]
        return shared.part(self.index, x)

    def extra_repr(self) -> str:
        shared: _SharedCall = self.__dict__["_shared"]
        start, stop = shared.bounds[self.index], shared.bounds[self.index + 1]
        return f"columns {start}:{stop} of {shared.fused_name}"


def _concatenated(parts: list[torch.nn.Linear]) -> torch.nn.Linear:
    """One Linear whose output is the parts' outputs side by side."""
    first = parts[0]
    has_bias = first.bias is not None
    weight = torch.cat([p.weight.detach() for p in parts])
    fused = torch.nn.Linear(
        first.in_features, weight.shape[0], bias=has_bias, device=weight.device, dtype=weight.dtype
    )
    with torch.no_grad():
        fused.weight.copy_(weight)
        if has_bias:
            fused.bias.copy_(torch.cat([p.bias.detach() for p in parts]))  # type: ignore[union-attr]
    fused.requires_grad_(False)
    return fused


def _fusable_parts(module: torch.nn.Module, names: tuple[str, ...]) -> list[torch.nn.Linear] | None:
    """The named plain Linears of ``module`` when they can share one GEMM, else None."""
    parts = [getattr(module, name, None) for name in names]
    if not all(type(p) is torch.nn.Linear for p in parts):
        return None
    linears: list[torch.nn.Linear] = parts  # type: ignore[assignment]
    first = linears[0]
    same = all(
        p.in_features == first.in_features
        and p.weight.dtype == first.weight.dtype
        and p.weight.device == first.weight.device
        and (p.bias is None) == (first.bias is None)
        for p in linears
    )
    return linears if same else None


def _fuse(module: torch.nn.Module, fused_name: str) -> bool:
    names = PARTS[fused_name]
    parts = _fusable_parts(module, names)
    if parts is None or hasattr(module, fused_name):
        return False
    setattr(module, fused_name, _concatenated(parts))
    shared = _SharedCall(module, fused_name, [p.out_features for p in parts])
    for index, name in enumerate(names):
        setattr(module, name, ProjectionSlice(shared, index, parts[0].in_features))
    return True


def fuse_projections(model: torch.nn.Module) -> int:
    """Fuse q/k/v and gate/up of every decoder layer that has them, in place; returns how many.

    A layer counts when both its attention and its MLP were fused. Modules
    without these names (GPT-2's ``c_attn`` is fused already), quantized or
    mismatched projections are left as they are. Applying it twice is harmless.
    """
    layers = 0
    for module in list(model.modules()):
        attention = getattr(module, "self_attn", None)
        mlp = getattr(module, "mlp", None)
        if attention is None or mlp is None:
            continue
        fused_attention = _fuse(attention, FUSED_ATTENTION)
        fused_mlp = _fuse(mlp, FUSED_MLP)
        layers += int(fused_attention and fused_mlp)
    if layers:
        log.debug("fused q/k/v and gate/up projections in %d layers", layers)
    return layers


def fused_parts(
    module: torch.nn.Module, fused_name: str
) -> tuple[torch.nn.Module, list[int]] | None:
    """The fused module and its parts' widths, when ``module`` was fused; else None."""
    fused = getattr(module, fused_name, None)
    slices = [getattr(module, name, None) for name in PARTS[fused_name]]
    if fused is None or not all(isinstance(s, ProjectionSlice) for s in slices):
        return None
    return fused, [s.out_features for s in slices]  # type: ignore[union-attr]
