"""Penalties and logit bias: per position, with the drafts before each position counted."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from specpair_runtime.engine.penalties import Penalties, PenaltyRow, apply_penalties

VOCAB = 12


def reference(
    logits: list[float], penalties: Penalties, prompt: Sequence[int], output: list[int]
) -> list[float]:
    """One position, written out as the formulas say (float64, no tensors)."""
    out = list(logits)
    for token, bias in penalties.logit_bias:
        out[token] += bias
    for token in range(len(out)):
        count = output.count(token)
        if penalties.repetition != 1.0 and (count or token in prompt):
            r = penalties.repetition
            out[token] = out[token] / r if out[token] > 0 else out[token] * r
        out[token] -= penalties.frequency * count + penalties.presence * (count > 0)
    return out


def test_each_position_counts_the_drafts_before_it() -> None:
    torch.manual_seed(0)
    logits = torch.randn(9, VOCAB) * 3
    drafts = torch.tensor([4, 4, 7, 1, 2])  # row a: 4 4 7; row b: 1 2
    a = PenaltyRow(
        Penalties.of(presence=0.5, frequency=0.3, repetition=1.3, logit_bias={2: 5.0}),
        first_position=0,
        positions=4,  # verifies 3 drafts: positions after 0, 1, 2, 3 drafts
        prompt_ids=[9, 10],
        output_ids=[4, 5, 5],
        draft_start=0,
    )
    b = PenaltyRow(
        Penalties.of(frequency=1.0),
        first_position=6,
        positions=3,
        prompt_ids=[0],
        output_ids=[],
        draft_start=3,
    )
    out = logits.clone()
    apply_penalties(out, [a, b], drafts)
    for i in range(4):
        context = [4, 5, 5, *drafts[:i].tolist()]
        expected = reference(logits[i].tolist(), a.penalties, a.prompt_ids, context)
        assert out[i].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-5), i
    for i in range(3):
        context = drafts[3 : 3 + i].tolist()
        expected = reference(logits[6 + i].tolist(), b.penalties, b.prompt_ids, context)
        assert out[6 + i].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-5), i
    # Rows 4 and 5 belong to nobody: untouched.
    assert torch.equal(out[[4, 5]], logits[[4, 5]])


def test_a_draft_forward_sees_the_drafts_proposed_before_it() -> None:
    """Draft forward j scores one position after the row's first j drafts."""
    logits = torch.zeros(1, VOCAB)
    drafts = torch.tensor([3, 3, 6])
    row = PenaltyRow(
        Penalties.of(frequency=1.0), 0, 1, prompt_ids=[], output_ids=[3], drafts_before=2
    )
    apply_penalties(logits, [row], drafts)
    assert logits[0, 3] == -3.0  # one committed, two drafted
    assert logits[0, 6] == 0.0  # the third draft comes after this position


def test_inactive_rows_and_no_rows_change_nothing() -> None:
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    apply_penalties(logits, [PenaltyRow(Penalties(), 0, 3, [1], [1, 2])])
    apply_penalties(logits, [])
    assert torch.equal(logits, before)


def test_repetition_divides_positive_and_multiplies_negative_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    row = PenaltyRow(Penalties.of(repetition=2.0), 0, 1, prompt_ids=[0], output_ids=[1])
    apply_penalties(logits, [row])
    assert logits.tolist() == [[1.0, -4.0, 2.0, -2.0]]


def test_masked_tokens_stay_masked() -> None:
    logits = torch.tensor([[float("-inf"), 1.0, 0.5]])
    row = PenaltyRow(
        Penalties.of(presence=2.0, frequency=2.0, repetition=1.5, logit_bias={0: 100.0}),
        0,
        1,
        prompt_ids=[0],
        output_ids=[0, 1],
    )
    apply_penalties(logits, [row])
    assert logits[0, 0] == float("-inf")
    assert torch.isfinite(logits[0, 1:]).all()


def test_positions_after_drafts_need_the_drafts() -> None:
    row = PenaltyRow(Penalties.of(presence=1.0), 0, 2, prompt_ids=[], output_ids=[])
    with pytest.raises(ValueError, match="drafts"):
        apply_penalties(torch.zeros(2, VOCAB), [row])


@pytest.mark.parametrize(
    ("penalties", "message"),
    [
        (Penalties.of(presence=2.5), "presence_penalty: must be in"),
        (Penalties.of(frequency=float("nan")), "frequency_penalty: must be in"),
        (Penalties.of(repetition=0.0), "repetition_penalty: must be > 0"),
        (Penalties.of(logit_bias={VOCAB: 1.0}), "token id 12 is outside"),
        (Penalties.of(logit_bias={1: 101.0}), r"bias of token 1 must be in \[-100, 100\]"),
    ],
)
def test_validation_names_the_field(penalties: Penalties, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        penalties.validate(VOCAB)


def test_logit_bias_is_sorted_and_hashable() -> None:
    p = Penalties.of(logit_bias={5: -1.0, 2: 3.0})
    assert p.logit_bias == ((2, 3.0), (5, -1.0))
    assert hash(p) == hash(Penalties.of(logit_bias={2: 3.0, 5: -1.0}))


def test_bf16_logits_stay_bf16() -> None:
    """CUDA's verify logits are bf16: the penalties compute in fp32 and write back."""
    logits = torch.tensor([[2.0, -2.0, 1.0]], dtype=torch.bfloat16)
    row = PenaltyRow(Penalties.of(repetition=2.0, logit_bias={2: 1.0}), 0, 1, [0], [1])
    apply_penalties(logits, [row])
    assert logits.dtype == torch.bfloat16
    assert logits.float().tolist() == [[1.0, -4.0, 2.0]]
