"""KV-cache rollback, row select/merge and compaction against fresh prefills."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from tools.tiny_models import ModelKind, build_model, build_tokenizer
from transformers import PreTrainedModel

from specpair_runtime.engine.kvcache import RaggedCache, cache_tensors, crop_cache

CPU = torch.device("cpu")
ATOL = 1e-5


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model(request: pytest.FixtureRequest) -> PreTrainedModel:
    kind: ModelKind = request.param
    return build_model(kind, build_tokenizer(), seed=3)


def _feed(
    model: PreTrainedModel, cache: RaggedCache, chunks: Sequence[Sequence[int]]
) -> torch.Tensor:
    """Append ragged chunks (right-padded) and return logits [B, W, V]."""
    width = max(len(c) for c in chunks)
    ids = torch.tensor([list(c) + [0] * (width - len(c)) for c in chunks])
    inputs = cache.prepare([len(c) for c in chunks], width)
    with torch.inference_mode():
        out = model(
            input_ids=ids,
            position_ids=inputs.position_ids,
            attention_mask=inputs.attention_mask,
            cache=cache.cache,
            use_cache=True,
        )
    logits: torch.Tensor = out.logits
    return logits


def _fresh(model: PreTrainedModel, tokens: Sequence[int]) -> tuple[RaggedCache, torch.Tensor]:
    cache = RaggedCache(1, CPU, torch.float32)
    logits = _feed(model, cache, [tokens])
    return cache, logits[0, -1]


def _row_slots(cache: RaggedCache, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A row's real (non-hole) cache slots, per layer."""
    keep = cache.valid[row]
    return [(k[row][:, keep], v[row][:, keep]) for k, v in cache_tensors(cache.cache)]


def _copy(cache: RaggedCache) -> RaggedCache:
    copy = RaggedCache(0, CPU, torch.float32)
    copy.merge(cache)
    return copy


def _assert_row_equals_fresh(
    model: PreTrainedModel, original: RaggedCache, row: int, prefix: Sequence[int], probe: int
) -> None:
    """Row ``row`` holds exactly ``prefix``: same cache slots and next-token logits."""
    cache = _copy(original)  # the probe below appends to every row
    fresh, _ = _fresh(model, prefix)
    assert cache.lengths[row] == len(prefix)
    for (k1, v1), (k2, v2) in zip(_row_slots(cache, row), _row_slots(fresh, 0), strict=True):
        assert torch.allclose(k1, k2, atol=ATOL) and torch.allclose(v1, v2, atol=ATOL)
    # The next token after the prefix sees only the prefix.
    rows = cache.rows
    logits = _feed(model, cache, [[probe]] * rows)[row, 0]
    _, expected = _fresh(model, [*prefix, probe])
    assert torch.allclose(logits, expected, atol=ATOL)


def test_crop_takes_a_length_and_removes_the_tail(model: PreTrainedModel) -> None:
    cache, _ = _fresh(model, [5, 6, 7, 8, 9])
    crop_cache(cache.cache, 3)
    assert all(k.shape[2] == 3 for k, _ in cache_tensors(cache.cache))


def test_rollback_of_one_row_equals_fresh_prefill(model: PreTrainedModel) -> None:
    prompt = [11, 12, 13, 14]
    for keep in range(1, 5):
        cache, _ = _fresh(model, prompt)
        _feed(model, cache, [[20, 21, 22, 23]])
        cache.rollback([keep], 4)
        assert cache.physical_length == len(prompt) + keep  # a batch of one never has holes
        _assert_row_equals_fresh(model, cache, 0, [*prompt, 20, 21, 22, 23][: 4 + keep], probe=30)


def test_ragged_rollback_in_a_batch_equals_fresh_prefills(model: PreTrainedModel) -> None:
    prompts = [[5, 6, 7, 8, 9, 10], [40, 41], [50, 51, 52, 53]]
    cache = RaggedCache(3, CPU, torch.float32)
    _feed(model, cache, prompts)  # right-padded prefill
    drafts = [[60, 61, 62], [70, 71, 72], [80, 81, 82]]
    _feed(model, cache, drafts)
    keep = [0, 3, 1]
    cache.rollback(keep, 3)
    assert cache.holes > 0
    for row in range(3):
        _assert_row_equals_fresh(model, cache, row, prompts[row] + drafts[row][: keep[row]], 90)


def test_select_merge_and_compact_keep_rows_intact(model: PreTrainedModel) -> None:
    prompts = [[5, 6, 7], [20, 21, 22, 23, 24, 25, 26], [30]]
    cache = RaggedCache(3, CPU, torch.float32)
    _feed(model, cache, prompts)
    _feed(model, cache, [[1, 2], [3, 4], [5, 6]])
    cache.rollback([2, 0, 1], 2)
    sequences = [prompts[0] + [1, 2], prompts[1], prompts[2] + [5]]

    cache.select([2, 0])
    newcomer = RaggedCache(1, CPU, torch.float32)
    _feed(model, newcomer, [[90, 91, 92, 93, 94, 95, 96, 97, 98]])
    cache.merge(newcomer)
    expected = [sequences[2], sequences[0], [90, 91, 92, 93, 94, 95, 96, 97, 98]]
    assert cache.lengths == [len(s) for s in expected]

    cache.compact()
    assert cache.physical_length == max(len(s) for s in expected)
    for row, prefix in enumerate(expected):
        _assert_row_equals_fresh(model, cache, row, prefix, probe=77)


def test_merging_into_an_empty_cache_and_selecting_nothing(model: PreTrainedModel) -> None:
    cache = RaggedCache(0, CPU, torch.float32)
    one = RaggedCache(1, CPU, torch.float32)
    _feed(model, one, [[3, 4, 5]])
    cache.merge(one)
    assert cache.rows == 1 and cache.lengths == [3]
    cache.select([])
    assert cache.rows == 0 and cache.physical_length == 0
    empty_rows = RaggedCache(2, CPU, torch.float32)  # prompts of one token: nothing prefilled
    cache.merge(empty_rows)
    _feed(model, cache, [[8], [9]])
    _assert_row_equals_fresh(model, cache, 1, [9], probe=10)


def test_maybe_compact_triggers_on_many_holes() -> None:
    cache = RaggedCache(2, CPU, torch.float32)
    cache.valid = torch.ones((2, 100), dtype=torch.bool)
    cache.valid[0, 10:90] = False
    cache.lengths = [20, 100]
    assert cache.maybe_compact()  # no layers yet: only the bookkeeping moves
    assert cache.valid[0, :20].all() and not cache.valid[0, 20:].any()
