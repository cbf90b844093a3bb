"""The engine's own decoder loop for Llama-family models whose projections are fused.

transformers' model forward wraps every layer and attention call in
decorators, keyword plumbing and mask preparation that a flat ragged step
never needs; on the 0.5B draft of ``make bench`` that was about a tenth of a
1-token forward on a 2-core CPU.
This loop runs the same operations in the same order as the model's own
forward, so its output is the same bits over the same cache
(``test_decoder.py`` checks it), and it calls the fused q/k/v and gate/up
projections (``fused_projections.py``) once each. Models it does not know, or
whose projections were not fused, run through transformers' forward instead
(``ModelRunner``).

It also spends fewer small ops per layer. After a large GEMM the CPU's
caches hold weights, not the dispatcher's code and data: on 2 AMD EPYC
vCPUs the first small op after an 8960 -> 1536 GEMM took 27 us against 3 us,
and an RMSNorm 73 us against 19 us. The 1.5B target spent about 17 ms of a
245 ms 1-token forward in norms, rotary, KV writes and attention, and the
int4 0.5B draft about 6 of 24 ms. So:

- RMSNorm is the modeling file's arithmetic written out, without the module
  call and the casts that are no-ops in the model's dtype;
- q and k rotate in one pass over ``[1, T, Hq + Hkv, D]``, with the sign of
  ``rotate_half`` folded into a ``sin`` built once per forward:
  ``cat(-x2, x1) * sin == cat(x2, x1) * cat(-sin1, sin2)`` bit for bit,
  because negation is exact;
- keys and values go to the storage in its ``[T, H, D]`` layout, without a
  transpose.

Both rewrites are checked at construction against the modules they replace,
on a random probe in the model's dtype; a model whose norm or rotation gives
other bits runs through transformers' forward.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from specpair_runtime.engine.attention import slot_attention
from specpair_runtime.engine.fused_projections import FUSED_ATTENTION, FUSED_MLP, fused_parts
from specpair_runtime.engine.kvcache import BATCH_KEY, FlatBatch, SlotCache

log = logging.getLogger(__name__)

# Same layer: pre-norm residual blocks, q/k/v and gate/up projections, RoPE by
# rotating halves, SiLU-gated MLP. Others (Qwen3's q/k norms, Gemma's scaled
# embeddings) differ in details this loop would silently skip.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2"})


@dataclass(frozen=True)
class _Layer:
    input_norm: Norm
    attention: torch.nn.Module
    qkv: torch.nn.Module
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    o_proj: torch.nn.Module
    post_norm: Norm
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
    input_norm = Norm.of(_child(module, "input_layernorm"))
    post_norm = Norm.of(_child(module, "post_attention_layernorm"))
    if input_norm is None or post_norm is None:
        return None
    head_dim = int(attention.head_dim)
    q_size, k_size, _ = qkv[1]
    return _Layer(
        input_norm=input_norm,
        attention=attention,
        qkv=qkv[0],
        heads=q_size // head_dim,
        kv_heads=k_size // head_dim,
        head_dim=head_dim,
        scaling=float(attention.scaling),
        o_proj=_child(attention, "o_proj"),
        post_norm=post_norm,
        gate_up=gate_up[0],
        gate_up_sizes=gate_up[1],
        act=mlp.act_fn,
        down=_child(mlp, "down_proj"),
    )


@dataclass(frozen=True)
class Norm:
    """Llama's and Qwen2's RMSNorm: its weight and epsilon."""

    weight: torch.Tensor
    eps: float

    @staticmethod
    def of(module: torch.nn.Module) -> Norm | None:
        weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
        if not isinstance(weight, torch.Tensor) or not isinstance(eps, float):
            return None
        return Norm(weight, eps)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """The module's ``forward``: the same operations, minus the casts that are no-ops."""
        dtype = hidden.dtype
        upcast = dtype != torch.float32
        states = hidden.to(torch.float32) if upcast else hidden
        states = states * torch.rsqrt(states.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * (states.to(dtype) if upcast else states)


def signed_rotary(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [1, T, D] -> [1, T, 1, D] each, the first half of ``sin`` negated."""
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos[:, :, None], signed[:, :, None]


def rotate(states: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE by rotating halves over ``states`` [1, T, H, D] (see ``signed_rotary``)."""
    half = states.shape[-1] // 2
    swapped = torch.cat((states[..., half:], states[..., :half]), dim=-1)
    rotated: torch.Tensor = states * cos + swapped * signed_sin
    return rotated


def _same_bits(
    layer: _Layer, norms: list[tuple[torch.nn.Module, Norm]], modeling_rotary: RotaryFn
) -> bool:
    """True when ``Norm`` and ``rotate`` give the modules' own bits on a random probe."""
    weight = norms[0][1].weight
    generator = torch.Generator(device="cpu").manual_seed(0)

    def probe(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(weight.device, weight.dtype)

    tokens, dim = 3, layer.head_dim
    with torch.no_grad():
        for module, norm in norms:
            hidden = probe(1, tokens, int(norm.weight.shape[-1]))
            if not torch.equal(module(hidden), norm(hidden)):
                return False
        q = probe(1, tokens, layer.heads, dim)
        k = probe(1, tokens, layer.kv_heads, dim)
        cos, sin = probe(1, tokens, dim), probe(1, tokens, dim)
        expected_q, expected_k = modeling_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        joint = rotate(torch.cat((q, k), dim=2), *signed_rotary(cos, sin))
        return torch.equal(joint[:, :, : layer.heads], expected_q.transpose(1, 2)) and torch.equal(
            joint[:, :, layer.heads :], expected_k.transpose(1, 2)
        )


class DecoderLoop:
    """Hidden states of a flat ragged batch, written to and read from the slot cache."""

    def __init__(self, base: torch.nn.Module, layers: list[_Layer], norm: Norm) -> None:
        self.embed = _child(base, "embed_tokens")
        self.rotary = _child(base, "rotary_emb")
        self.norm = norm
        self.layers = layers

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
        # The modeling module's own rotation, which the probe holds ``rotate`` to.
        modeling_rotary = getattr(sys.modules[type(model).__module__], "apply_rotary_pos_emb", None)
        layers = [_layer(module) for module in base.layers]
        final_norm = Norm.of(base.norm)
        if modeling_rotary is None or final_norm is None or not layers or None in layers:
            return None
        known = [layer for layer in layers if layer is not None]
        norms = [(base.norm, final_norm)]
        for module, layer in zip(base.layers, known, strict=True):
            norms += [(module.input_layernorm, layer.input_norm)]
            norms += [(module.post_attention_layernorm, layer.post_norm)]
        if not _same_bits(known[0], norms, modeling_rotary):
            name = type(model).__name__
            log.info("%s: its norm or rotation differs; it runs its own forward", name)
            return None
        return DecoderLoop(base, known, final_norm)

    def __call__(self, input_ids: torch.Tensor, cache: SlotCache) -> torch.Tensor:
        """input_ids [1, T] -> the final-normed hidden states [1, T, hidden]."""
        batch: FlatBatch = cache.batch
        attention_kwargs: dict[str, Any] = {BATCH_KEY: batch}
        hidden = self.embed(input_ids)
        tokens = hidden.shape[1]
        cos, signed_sin = signed_rotary(*self.rotary(hidden, batch.position_ids))
        for index, layer in enumerate(self.layers):
            residual = hidden
            qkv = layer.qkv(layer.input_norm(hidden))
            joint_heads, dim = layer.heads + layer.kv_heads, layer.head_dim
            qk = qkv[..., : joint_heads * dim].view(1, tokens, joint_heads, dim)
            qk = rotate(qk, cos, signed_sin)
            k = qk[0, :, layer.heads :]  # [T, Hkv, D], the storage's layout
            v = qkv[0, :, joint_heads * dim :].view(tokens, layer.kv_heads, dim)
            keys, values = cache.write(index, k, v)
            q = qk[:, :, : layer.heads].transpose(1, 2)
            out, _ = slot_attention(
                layer.attention, q, keys, values, None, scaling=layer.scaling, **attention_kwargs
            )
            hidden = residual + layer.o_proj(out.reshape(1, tokens, -1))
            residual = hidden
            gate, up = layer.gate_up(layer.post_norm(hidden)).split(layer.gate_up_sizes, dim=-1)
            hidden = residual + layer.down(layer.act(gate) * up)
        return self.norm(hidden)
