"""Fused q/k/v and gate/up projections: the same bits, one GEMM, HF's code still runs."""

from __future__ import annotations

import copy

import pytest
import torch
from tools.tiny_models import build_gpt2, build_llama, build_qwen2, build_tokenizer
from transformers import PreTrainedModel

from specpair_runtime.engine.cpu.int4 import quantize_int4_weights
from specpair_runtime.engine.cpu.onednn import onednn_available, use_onednn_linears
from specpair_runtime.engine.fused_projections import (
    FUSED_ATTENTION,
    FUSED_MLP,
    ProjectionSlice,
    fuse_projections,
    fused_parts,
)

IDS = torch.tensor([[5, 17, 33, 2, 9, 41, 8, 12]])


def models() -> list[PreTrainedModel]:
    tok = build_tokenizer()
    return [build_llama(tok, seed=1), build_qwen2(tok, seed=1)]


def logits(model: PreTrainedModel) -> torch.Tensor:
    with torch.inference_mode():
        out: torch.Tensor = model(input_ids=IDS, use_cache=False).logits
    return out


@pytest.mark.parametrize("model", models(), ids=["llama", "qwen2"])
def test_fused_model_gives_the_same_bits_through_transformers_forward(
    model: PreTrainedModel,
) -> None:
    reference = logits(model)
    fused = copy.deepcopy(model)
    assert fuse_projections(fused) == model.config.num_hidden_layers
    assert torch.equal(logits(fused), reference)
    attention = fused.model.layers[0].self_attn
    assert isinstance(attention.q_proj, ProjectionSlice)
    parts = fused_parts(attention, FUSED_ATTENTION)
    assert parts is not None
    width = model.model.layers[0].self_attn
    assert parts[1] == [width.q_proj.out_features, width.k_proj.out_features, 32]
    assert fused_parts(fused.model.layers[0].mlp, FUSED_MLP) is not None


@pytest.mark.parametrize("prepare", ["onednn", "int4"])
def test_fusing_before_the_kernels_gives_the_same_bits(prepare: str) -> None:
    """The engine's kernels see one Linear per fused projection; each column is its own row."""
    if prepare == "onednn" and not onednn_available():
        pytest.skip("this torch build has no oneDNN linear")
    model = build_qwen2(build_tokenizer(), seed=2)
    fused = copy.deepcopy(model)
    fuse_projections(fused)
    for each in (model, fused):
        if prepare == "onednn":
            use_onednn_linears(each)
        else:
            assert quantize_int4_weights(each) > 0
    assert torch.equal(logits(fused), logits(model))


def test_transformers_code_runs_one_gemm_per_fused_projection_and_keeps_nothing() -> None:
    model = build_llama(build_tokenizer(), seed=4)
    fuse_projections(model)
    layer = model.model.layers[1]
    calls: list[str] = []
    for name, module in ((FUSED_ATTENTION, layer.self_attn), (FUSED_MLP, layer.mlp)):
        getattr(module, name).register_forward_hook(lambda *_, n=name: calls.append(n))
    logits(model)
    assert calls == [FUSED_ATTENTION, FUSED_MLP]
    # The shared result is dropped once every part took its columns.
    shared = layer.mlp.up_proj.__dict__["_shared"]
    assert shared.state is None


def test_a_part_called_twice_recomputes_instead_of_serving_a_stale_result() -> None:
    model = build_llama(build_tokenizer(), seed=5)
    attention = model.model.layers[0].self_attn
    separate = copy.deepcopy(attention)
    fuse_projections(model)
    x = torch.randn(1, 3, 64)
    y = torch.randn(1, 3, 64)
    with torch.inference_mode():
        assert torch.equal(attention.q_proj(x), separate.q_proj(x))
        assert torch.equal(attention.q_proj(y), separate.q_proj(y))  # another input
        assert torch.equal(attention.q_proj(y), separate.q_proj(y))  # q twice in a row
        assert torch.equal(attention.k_proj(x), separate.k_proj(x))


def test_models_without_separate_projections_are_left_alone() -> None:
    tok = build_tokenizer()
    gpt2 = build_gpt2(tok)
    assert fuse_projections(gpt2) == 0  # c_attn is fused already
    llama = build_llama(tok)
    assert fuse_projections(llama) == 2
    assert fuse_projections(llama) == 0  # twice is harmless
    mismatched = build_llama(tok)
    attention = mismatched.model.layers[0].self_attn
    attention.k_proj = torch.nn.Linear(64, 32, bias=True)  # q has no bias: not one GEMM
    assert fuse_projections(mismatched) == 1
    assert not isinstance(attention.q_proj, ProjectionSlice)
    assert isinstance(mismatched.model.layers[0].mlp.up_proj, ProjectionSlice)
