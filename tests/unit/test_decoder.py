"""The engine's own decoder loop: the same bits as transformers' forward, on every row shape."""

from __future__ import annotations

import copy
import dataclasses
import sys

import pytest
import torch
from tools.tiny_models import as_loaded, build_gpt2, build_llama, build_qwen2, build_tokenizer
from transformers import PreTrainedModel

from specpair_runtime.engine.cpu.onednn import onednn_available, use_onednn_linears
from specpair_runtime.engine.decoder import DecoderLoop
from specpair_runtime.engine.fused_projections import fuse_projections
from specpair_runtime.engine.kvcache import RowSpan
from specpair_runtime.engine.runner import ModelRunner

# (slot, position, tokens) per row, one list per forward: unequal prompts in
# chunks, then decode rows beside a verify and a chunk, then rows of one length.
STEPS = [
    [(0, 0, [5, 17, 33, 2, 9]), (1, 0, [41, 8]), (2, 0, [12, 30, 7, 19, 23, 4, 11])],
    [(0, 5, [3]), (1, 2, [28, 6, 15, 21]), (2, 7, [10, 14, 16])],
    [(0, 6, [20]), (1, 6, [22]), (2, 10, [24, 26, 29, 31, 35, 37])],
    [(0, 7, [38, 39, 40]), (1, 7, [42, 43, 44]), (2, 16, [45, 46, 47])],
]


def run(runner: ModelRunner, rows: list[tuple[int, int, list[int]]]) -> torch.Tensor:
    spans: list[RowSpan] = []
    ids: list[int] = []
    for slot, position, tokens in rows:
        spans.append(RowSpan(slot, len(ids), len(tokens), position))
        ids += tokens
    with torch.inference_mode():
        logits = runner.forward(spans, torch.tensor(ids), torch.arange(len(ids)))
    assert logits is not None
    return logits


def runners(model: PreTrainedModel, kernels: str) -> tuple[ModelRunner, ModelRunner]:
    """(the engine's loop, transformers' forward) over two copies of one fused model."""
    if kernels == "onednn" and not onednn_available():
        pytest.skip("this torch build has no oneDNN linear")
    tok = build_tokenizer()
    pair = [
        as_loaded(model, tok, "m", cpu_kernels="default"),
        as_loaded(copy.deepcopy(model), tok, "copy", cpu_kernels="default"),
    ]
    pair = [dataclasses.replace(loaded, dtype=model.dtype) for loaded in pair]
    if kernels == "onednn":
        for loaded in pair:
            use_onednn_linears(loaded.model)
    own, other = (ModelRunner(loaded, slots=3, max_length=64) for loaded in pair)
    assert own.decoder is not None
    other.decoder = None
    return own, other


@pytest.mark.parametrize("kernels", ["default", "onednn"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_own_loop_equals_transformers_forward_bit_for_bit(kind: str, kernels: str) -> None:
    tok = build_tokenizer()
    model = build_llama(tok, seed=6) if kind == "llama" else build_qwen2(tok, seed=6)
    own, reference = runners(model, kernels)
    for rows in STEPS:
        assert torch.equal(run(own, rows), run(reference, rows))
    assert own.storage is not None and reference.storage is not None
    assert torch.equal(own.storage.tensor, reference.storage.tensor)  # the same KV written
    # The dense (CUDA-graph) form of the last step, too.
    spans = [RowSpan(0, 0, 2, 10), RowSpan(1, 2, 2, 10)]
    ids = torch.tensor([1, 2, 3, 4])
    with torch.inference_mode():
        dense = own.forward(spans, ids, torch.arange(4), dense=True)
        expected = reference.forward(spans, ids, torch.arange(4), dense=True)
    assert dense is not None and expected is not None and torch.equal(dense, expected)


def test_loop_runs_only_models_it_knows_with_fused_projections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tok = build_tokenizer()
    llama = build_llama(tok)
    assert DecoderLoop.of(llama) is None  # projections not fused yet
    fuse_projections(llama)
    assert DecoderLoop.of(llama) is not None
    gpt2 = build_gpt2(tok)
    fuse_projections(gpt2)
    assert DecoderLoop.of(gpt2) is None
    other = build_llama(tok)
    fuse_projections(other)
    monkeypatch.setattr(type(other.config), "model_type", "qwen3")  # q/k norms: not run here
    assert DecoderLoop.of(other) is None


def test_a_model_whose_norm_or_rotation_gives_other_bits_runs_its_own_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loop's own norm and rotation are probed against the modules they stand for."""
    tok = build_tokenizer()
    model = build_qwen2(tok)
    fuse_projections(model)
    assert DecoderLoop.of(model) is not None
    modeling = sys.modules[type(model).__module__]
    original = modeling.apply_rotary_pos_emb

    def other_rotation(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q_out, k_out = original(q, k, cos, sin)
        return q_out.flip(-1), k_out.flip(-1)  # another rotation: other bits

    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", other_rotation)
    assert DecoderLoop.of(model) is None
    monkeypatch.undo()
    norm = model.model.layers[1].post_attention_layernorm
    monkeypatch.setattr(norm, "variance_epsilon", 1e-2)  # fine: the loop reads it from the module
    assert DecoderLoop.of(model) is not None
    monkeypatch.setattr(norm, "forward", lambda hidden: hidden * norm.weight)  # no normalizing
    assert DecoderLoop.of(model) is None


def test_own_loop_equals_transformers_forward_in_bfloat16() -> None:
    """The norm's upcast and the rotation in a half-precision dtype, as on CUDA."""
    tok = build_tokenizer()
    model = build_qwen2(tok, seed=3)
    model.requires_grad_(False).bfloat16()
    own, reference = runners(model, "default")
    for rows in STEPS:
        assert torch.equal(run(own, rows), run(reference, rows))
