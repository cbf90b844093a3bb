"""The engine's own decoder loop for Llama-family models whose projections are fused.

transformers' model forward wraps every layer and attention call in
decorators, keyword plumbing and mask preparation that a flat ragged step
never needs; on the 0.5B draft of ``make bench`` that was about a tenth of a
1-token forward on a 2-core CPU (docs/benchmarks.md, stop 33).
This loop runs the same modules with the same operations in the same order
(the layer's own RMSNorm, the rotary module and ``apply_rotary_pos_emb``
of the model's modeling file, ``act_fn``), so its
output is the same bits as the model's own forward over the same cache
(``test_decoder.py`` checks it), and it calls the fused q/k/v and gate/up
projections (``fused_projections.py``) once each. Models it does not know, or
whose projections were not fused, run through transformers' forward instead
(``ModelRunner``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from specpair_runtime.engine.attention import slot_attention
from specpair_runtime.engine.fused_projections import FUSED_ATTENTION, FUSED_MLP, fused_parts
from specpair_runtime.engine.kvcache import BATCH_KEY, FlatBatch, SlotCache

# Same layer: pre-norm residual blocks, q/k/v and gate/up projections, RoPE by
# rotating halves, SiLU-gated MLP. Others (Qwen3's q/k norms, Gemma's scaled
# embeddings) differ in details this loop would silently skip.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2"})


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.nn.Module
    attention: torch.nn.Module
    qkv: torch.nn.Module
    qkv_sizes: list[int]
    head_dim: int
    scaling: float
    o_proj: torch.nn.Module
    post_norm: torch.nn.Module
    gate_up: torch.nn.Module
    gate_up_sizes: list[int]
    act: Callable[[torch.Tensor], torch.Tensor]
    down: torch.nn.Module


RotaryFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
]


def _child(module: torch.nn.Module, name: str) -> torch.nn.Module:
    child = getattr(module, name)
    if not isinstance(child, torch.nn.Module):
        raise TypeError(f"{type(module).__name__}.{name} is not a module")
    return child


def _layer(module: torch.nn.Module) -> _Layer | None:
    attention = getattr(module, "self_attn", None)
    mlp = getattr(module, "mlp", None)
    if attention is None or mlp is None:
        return None
    qkv = fused_parts(attention, FUSED_ATTENTION)
    gate_up = fused_parts(mlp, FUSED_MLP)
    if qkv is None or gate_up is None:
        return None
    return _Layer(
        input_norm=_child(module, "input_layernorm"),
        attention=attention,
        qkv=qkv[0],
        qkv_sizes=qkv[1],
        head_dim=int(attention.head_dim),
        scaling=float(attention.scaling),
        o_proj=_child(attention, "o_proj"),
        post_norm=_child(module, "post_attention_layernorm"),
        gate_up=gate_up[0],
        gate_up_sizes=gate_up[1],
        act=mlp.act_fn,
        down=_child(mlp, "down_proj"),
    )


class DecoderLoop:
    """Hidden states of a flat ragged batch, written to and read from the slot cache."""

    def __init__(self, base: torch.nn.Module, layers: list[_Layer], rotate: RotaryFn) -> None:
        self.embed = _child(base, "embed_tokens")
        self.rotary = _child(base, "rotary_emb")
        self.norm = _child(base, "norm")
        self.layers = layers
        self.apply_rotary = rotate

    @staticmethod
    def of(model: torch.nn.Module) -> DecoderLoop | None:
        """The loop for ``model`` (a ``...ForCausalLM``); None where it runs its own forward."""
        config = getattr(model, "config", None)
        if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
            return None
        base = getattr(model, "base_model", None)
        if base is None or not all(
            hasattr(base, name) for name in ("embed_tokens", "rotary_emb", "norm", "layers")
        ):
            return None
        # The modeling module's own function, so the rotation is the one its forward runs.
        rotate = getattr(sys.modules[type(model).__module__], "apply_rotary_pos_emb", None)
        layers = [_layer(module) for module in base.layers]
        if rotate is None or not layers or any(layer is None for layer in layers):
            return None
        return DecoderLoop(base, layers, rotate)  # type: ignore[arg-type]

    def __call__(self, input_ids: torch.Tensor, cache: SlotCache) -> torch.Tensor:
        """input_ids [1, T] -> the final-normed hidden states [1, T, hidden]."""
        batch: FlatBatch = cache.batch
        attention_kwargs: dict[str, Any] = {BATCH_KEY: batch}
        hidden = self.embed(input_ids)
        tokens = hidden.shape[1]
        cos, sin = self.rotary(hidden, batch.position_ids)
        for index, layer in enumerate(self.layers):
            residual = hidden
            q, k, v = layer.qkv(layer.input_norm(hidden)).split(layer.qkv_sizes, dim=-1)
            shape = (1, tokens, -1, layer.head_dim)
            q = q.view(shape).transpose(1, 2)
            k = k.view(shape).transpose(1, 2)
            v = v.view(shape).transpose(1, 2)
            q, k = self.apply_rotary(q, k, cos, sin)
            keys, values = cache.update(k, v, index)
            out, _ = slot_attention(
                layer.attention, q, keys, values, None, scaling=layer.scaling, **attention_kwargs
            )
            hidden = residual + layer.o_proj(out.reshape(1, tokens, -1))
            residual = hidden
            gate, up = layer.gate_up(layer.post_norm(hidden)).split(layer.gate_up_sizes, dim=-1)
            hidden = residual + layer.down(layer.act(gate) * up)
        normed: torch.Tensor = self.norm(hidden)
        return normed
