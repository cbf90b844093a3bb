"""The static slot KV storage: rollback by length, chunked prefill, fixed storage."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from tools.tiny_models import ModelKind, as_loaded, build_model, build_pair, build_tokenizer

from specpair_runtime.config import SpeculationKnobs
from specpair_runtime.engine import kvcache
from specpair_runtime.engine.api import SamplingParams
from specpair_runtime.engine.kvcache import (
    KVGeometry,
    RowSpan,
    SlotGroup,
    build_flat_batch,
    lower_right_causal,
)
from specpair_runtime.engine.options import EngineOptions
from specpair_runtime.engine.runner import ModelRunner
from specpair_runtime.engine.speculative import SpeculativeEngine

ATOL = 1e-5
TOKENS = [5, 17, 33, 2, 9, 41, 8, 12, 30, 7, 19, 23, 4, 11, 3, 28, 6, 15, 21, 10]


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def runner(request: pytest.FixtureRequest) -> ModelRunner:
    kind: ModelKind = request.param
    tok = build_tokenizer()
    model = build_model(kind, tok, seed=3)
    return ModelRunner(as_loaded(model, tok, "m"), slots=3, max_length=64)


def _forward(runner: ModelRunner, rows: list[tuple[int, int, list[int]]]) -> list[torch.Tensor]:
    """rows: (slot, position, tokens); returns each row's logits at its last token."""
    spans: list[RowSpan] = []
    ids: list[int] = []
    last: list[int] = []
    for slot, position, tokens in rows:
        spans.append(RowSpan(slot, len(ids), len(tokens), position))
        ids += tokens
        last.append(len(ids) - 1)
    with torch.inference_mode():
        logits = runner.forward(spans, torch.tensor(ids), torch.tensor(last))
    assert logits is not None
    return list(logits)


def test_geometry_counts_keys_and_values() -> None:
    tok = build_tokenizer()
    model = build_model("llama", tok, seed=0)
    geometry = KVGeometry.of(model.config)
    assert geometry.layers == model.config.num_hidden_layers
    assert geometry.bytes_per_token(torch.float32) == (
        2 * geometry.layers * geometry.kv_heads * geometry.head_dim * 4
    )


def test_lower_right_causal_mask() -> None:
    mask = lower_right_causal(2, 4, groups=2, device=torch.device("cpu"))
    assert mask.tolist() == [[True, True, True, False], [True, True, True, True]] * 2


def test_chunked_prefill_equals_one_forward(runner: ModelRunner) -> None:
    (whole,) = _forward(runner, [(0, 0, TOKENS)])
    for start in range(0, len(TOKENS), 7):
        (chunked,) = _forward(runner, [(1, start, TOKENS[start : start + 7])])
    assert torch.allclose(whole, chunked, atol=ATOL)


def test_rollback_is_not_advancing_the_length(runner: ModelRunner) -> None:
    prefix, rejected, accepted = TOKENS[:10], [40, 41, 42], [13]
    _forward(runner, [(0, 0, prefix)])
    _forward(runner, [(0, len(prefix), rejected)])  # a verify whose drafts were all rejected
    (after,) = _forward(runner, [(0, len(prefix), accepted)])  # overwrites position 10
    (fresh,) = _forward(runner, [(2, 0, prefix + accepted)])
    assert torch.allclose(after, fresh, atol=ATOL)


def test_unequal_rows_in_one_flat_forward_equal_separate_forwards(runner: ModelRunner) -> None:
    a, b, c = TOKENS[:12], TOKENS[3:5], TOKENS[5:6]
    together = _forward(runner, [(0, 0, a), (1, 0, b), (2, 0, c)])
    alone = [_forward(runner, [(slot, 0, t)])[0] for slot, t in ((0, a), (1, b), (2, c))]
    for joint, solo in zip(together, alone, strict=True):
        assert torch.allclose(joint, solo, atol=ATOL)
    # Verify-shaped rows (several tokens after a prefix) against one-token steps.
    spans = [(0, len(a), [7, 8, 9]), (1, len(b), [10, 11])]
    verify = _forward(runner, spans)
    _forward(runner, [(0, len(a), [7, 8]), (1, len(b), [10])])
    steps = _forward(runner, [(0, len(a) + 2, [9]), (1, len(b) + 1, [11])])
    for joint, solo in zip(verify, steps, strict=True):
        assert torch.allclose(joint, solo, atol=ATOL)


def test_rows_in_slot_order_attend_through_slices_with_the_same_result(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu = torch.device("cpu")
    in_order = [RowSpan(0, 0, 1, 4), RowSpan(1, 1, 1, 6), RowSpan(2, 2, 1, 2)]
    (group,) = build_flat_batch(in_order, cpu, groups=1).slot_groups
    assert group.contiguous_start == 0
    gapped = [RowSpan(0, 0, 1, 4), RowSpan(2, 1, 1, 2)]  # slot 1 is not in the step
    assert build_flat_batch(gapped, cpu, groups=1).slot_groups[0].contiguous_start is None
    _forward(runner, [(0, 0, TOKENS[:4]), (1, 0, TOKENS[4:10]), (2, 0, TOKENS[10:12])])
    step = [(0, 4, [7]), (1, 6, [8]), (2, 2, [9])]
    sliced = _forward(runner, step)
    # The same step through the gather/scatter form.
    original = kvcache._slot_group

    def without_slices(*args: Any) -> SlotGroup:
        return dataclasses.replace(original(*args), contiguous_start=None)

    monkeypatch.setattr(kvcache, "_slot_group", without_slices)
    gathered = _forward(runner, step)
    for fast, slow in zip(sliced, gathered, strict=True):
        assert torch.equal(fast, slow)


def test_dense_attention_equals_varlen(runner: ModelRunner) -> None:
    """The CUDA-graph form (rows of equal length, masks from positions) gives the same logits."""
    _forward(runner, [(0, 0, TOKENS[:9]), (1, 0, TOKENS[9:13])])
    rows = [RowSpan(0, 0, 3, 9), RowSpan(1, 3, 3, 4)]
    ids = torch.tensor([1, 2, 3, 4, 5, 6])
    index = torch.arange(6)
    with torch.inference_mode():
        varlen = runner.forward(rows, ids, index)
        dense = runner.forward(rows, ids, index, dense=True)
    assert varlen is not None and dense is not None
    assert torch.allclose(varlen, dense, atol=ATOL)


def test_storage_is_never_reallocated_or_copied_across_steps() -> None:
    """100 steps of unequal prompts joining and leaving: the same tensors, the same memory."""
    pair = build_pair("llama", seed=0)
    tok = pair.tokenizer
    engine = SpeculativeEngine(
        as_loaded(pair.target, tok, "t"),
        as_loaded(pair.draft, tok, "d"),
        SpeculationKnobs(max_depth=3, min_depth=3, adaptive=False),
        options=EngineOptions(max_slots=3, max_length=256, max_step_tokens=16),
    )
    assert engine.draft is not None
    storages = [engine.target.storage, engine.draft.storage]
    assert storages[0] is not None and storages[1] is not None
    fingerprint = [(s.tensor.data_ptr(), tuple(s.tensor.shape)) for s in storages if s]
    lengths = [1, 40, 7, 90, 3, 25]
    submitted = 0
    for step in range(100):
        if step % 9 == 0 and submitted < 30:
            prompt = [(t * 7 + submitted) % 50 + 3 for t in range(lengths[submitted % 6])]
            engine.add_request(f"r{submitted}", prompt, SamplingParams(max_new_tokens=20))
            submitted += 1
        engine.step()
        assert [engine.target.storage, engine.draft.storage] == storages
        now = [(s.tensor.data_ptr(), tuple(s.tensor.shape)) for s in storages if s]
        assert now == fingerprint
    assert submitted > 6  # requests really came and went
