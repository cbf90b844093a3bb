"""The flat-batch rejection sampler and logits processing, on synthetic distributions.

The tests build padded ``[rows, k, V]`` cases and flatten them into the
sampler's layout (``_flat``), so each case reads as rows of drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from scipy.stats import chisquare
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specpair_runtime.engine import sampling
from specpair_runtime.engine.sampling import (
    SAMPLING_EPS,
    FlatLayout,
    SamplingTensors,
    StepIndex,
    draft_confidence,
    draft_sample,
    finite_rows,
    probabilities,
    process_logits,
    sanitize,
)

CPU = torch.device("cpu")


def _params(rows: int, temperature: float, top_k: int = 0, top_p: float = 1.0) -> SamplingTensors:
    return SamplingTensors.build([temperature] * rows, [top_k] * rows, [top_p] * rows, CPU)


def _flat(
    num_draft: list[int], k: int, *per_row: torch.Tensor
) -> tuple[FlatLayout, StepIndex, list[torch.Tensor]]:
    """Padded per-row tensors [R, K(+1), ...] -> the flat layout (row r keeps num_draft[r](+1))."""
    layout = FlatLayout.of(num_draft)
    flat = []
    for tensor in per_row:
        extra = tensor.shape[1] - k  # 0 for drafts, 1 for target positions
        flat.append(torch.cat([tensor[r, : n + extra] for r, n in enumerate(num_draft)]))
    return layout, StepIndex.of(layout, CPU), flat


def rejection_sample(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    num_draft: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, k = drafts.shape
    counts = [k] * rows if num_draft is None else num_draft.tolist()
    layout, index, (ids, q, p) = _flat(counts, k, drafts, draft_probs, target_probs)
    return sampling.rejection_sample(ids, q, p, generators, index, layout)


def greedy_verify(
    drafts: torch.Tensor, target_argmax: torch.Tensor, num_draft: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    layout, index, (ids, argmax) = _flat(num_draft.tolist(), drafts.shape[1], drafts, target_argmax)
    return sampling.greedy_verify(ids, argmax, index, layout)


def _rows(logits: torch.Tensor) -> torch.Tensor:
    """[R, S, V] -> [R * S, V] (one flat position per row and step)."""
    return logits.reshape(-1, logits.shape[-1])


def _chi_square_p(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit; categories with expected count < 5 are pooled."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    wanted = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    if wanted[-1] < 5:  # pool the tail into the smallest big category instead
        observed, wanted = observed[:-1], wanted[:-1]
        observed[-1] += counts[~big].sum()
        wanted[-1] += expected[~big].sum()
    wanted = wanted * observed.sum() / wanted.sum()
    if observed.numel() < 2:  # a single category: every sample must be in it
        return 1.0 if float(counts[~(probs > 0)].sum()) == 0 else 0.0
    return float(chisquare(observed.numpy(), wanted.numpy()).pvalue)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.9, 7, 0.9)],
)
def test_processing_matches_transformers_warpers(
    temperature: float, top_k: int, top_p: float
) -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 50) * 3
    flat = logits.reshape(12, 50)
    ours = process_logits(flat, _params(12, temperature, top_k, top_p)).reshape(3, 4, 50)
    theirs = TemperatureLogitsWarper(temperature)(None, flat)
    if top_k:
        theirs = TopKLogitsWarper(top_k)(None, theirs)
    if top_p < 1.0:
        theirs = TopPLogitsWarper(top_p)(None, theirs)
    theirs = theirs.reshape(3, 4, 50)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    finite = ~torch.isinf(ours)
    assert torch.allclose(ours[finite], theirs[finite])


def test_per_row_parameters_are_independent() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, 30)
    params = SamplingTensors.build([1.0, 0.5], [3, 0], [1.0, 0.5], CPU)
    both = probabilities(logits, params)
    alone0 = probabilities(logits[:1], _params(1, 1.0, 3, 1.0))
    alone1 = probabilities(logits[1:], _params(1, 0.5, 0, 0.5))
    assert torch.allclose(both[0], alone0[0]) and torch.allclose(both[1], alone1[0])
    assert int((both[0] > 0).sum()) == 3


def test_greedy_rows_are_one_hot_at_the_argmax() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0], [0.1, 2.0, -1.0]])
    probs = probabilities(logits, SamplingTensors.build([0.0, 1.0], [0, 0], [1.0, 1.0], CPU))
    assert probs[0].tolist() == [0.0, 1.0, 0.0]
    assert 0 < float(probs[1, 0]) < 1


def _synthetic(
    rows: int, k: int, vocab: int, seed: int, disagree: bool
) -> tuple[torch.Tensor, ...]:
    """Target p and draft q per position, independent of earlier tokens, plus draft samples."""
    generator = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(k + 1, vocab, generator=generator) * 1.5, dim=-1)
    if disagree:  # the draft puts its mass where the target puts little
        q = torch.softmax(-torch.log(p[:k]) * 1.2, dim=-1)
    else:
        q = torch.softmax(torch.log(p[:k]) + torch.randn(k, vocab, generator=generator), dim=-1)
    drafts = torch.stack(
        [torch.multinomial(q[j], rows, replacement=True, generator=generator) for j in range(k)],
        dim=1,
    )
    target = p.expand(rows, -1, -1)
    draft = q.expand(rows, -1, -1)
    return p, drafts, draft, target


@pytest.mark.parametrize("disagree", [False, True])
def test_rejection_sampling_keeps_the_target_distribution(disagree: bool) -> None:
    rows, k, vocab = 20000, 3, 12
    p, drafts, draft_probs, target_probs = _synthetic(rows, k, vocab, seed=3, disagree=disagree)
    torch.manual_seed(4)
    output, accepted = rejection_sample(drafts, draft_probs, target_probs, [None] * rows)
    # Position 0 always exists; position j exists when j-1 drafts were accepted,
    # and (target independent of context) is then distributed as p[j].
    assert _chi_square_p(output[:, 0], p[0]) > 0.01
    reached = accepted >= 1
    assert _chi_square_p(output[reached, 1], p[1]) > 0.01
    reached2 = accepted >= 2
    assert _chi_square_p(output[reached2, 2], p[2]) > 0.01
    all_in = accepted == k
    assert _chi_square_p(output[all_in, k], p[k]) > 0.01  # bonus tokens
    # The acceptance of position 0 is sum_x min(p, q) (Leviathan et al., eq. 1).
    expected_rate = float(torch.minimum(p[0], draft_probs[0, 0]).sum())
    observed_rate = float((accepted >= 1).double().mean())
    assert (
        abs(observed_rate - expected_rate) < 4 * (expected_rate * (1 - expected_rate) / rows) ** 0.5
    )
    if disagree:
        assert observed_rate < 0.3


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.8, 0, 0.85), (1.5, 6, 1.0)])
def test_processed_distributions_are_kept(temperature: float, top_k: int, top_p: float) -> None:
    rows, k, vocab = 20000, 2, 16
    generator = torch.Generator().manual_seed(5)
    target_logits = torch.randn(1, k + 1, vocab, generator=generator) * 1.2
    draft_logits = target_logits[:, :k] + torch.randn(1, k, vocab, generator=generator)
    p = probabilities(_rows(target_logits), _params(k + 1, temperature, top_k, top_p))
    q = probabilities(_rows(draft_logits), _params(k, temperature, top_k, top_p))
    drafts = torch.stack(
        [torch.multinomial(q[j], rows, replacement=True, generator=generator) for j in range(k)],
        dim=1,
    )
    torch.manual_seed(6)
    output, accepted = rejection_sample(
        drafts, q.expand(rows, -1, -1), p.expand(rows, -1, -1), [None] * rows
    )
    assert _chi_square_p(output[:, 0], p[0]) > 0.01
    assert _chi_square_p(output[accepted >= 1, 1], p[1]) > 0.01
    masked = p[0] == 0
    assert masked.any() and not masked[output[:, 0]].any()  # top-k/top-p tokens never appear


def test_per_row_generators_make_rows_reproducible() -> None:
    rows, k, vocab = 4, 3, 10
    _, drafts, draft_probs, target_probs = _synthetic(rows, k, vocab, seed=7, disagree=False)

    def run(order: list[int]) -> torch.Tensor:
        generators = [torch.Generator().manual_seed(100 + i) for i in order]
        output, _ = rejection_sample(
            drafts[order], draft_probs[order], target_probs[order], generators
        )
        return output

    first = run([0, 1, 2, 3])
    shuffled = run([2, 0, 3, 1])
    assert torch.equal(first[[2, 0, 3, 1]], shuffled)


def test_greedy_verify_accepts_matching_prefix_then_target_token() -> None:
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 2, 3], [5, 6, 7]])
    target_argmax = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [4, 2, 3, 8], [5, 6, 7, 8]])
    output, accepted = greedy_verify(drafts, target_argmax, torch.tensor([3, 3, 3, 2]))
    assert accepted.tolist() == [3, 1, 0, 2]
    assert output.tolist() == [[5, 6, 7, 8], [5, 6, -1, -1], [4, -1, -1, -1], [5, 6, 7, -1]]


def test_greedy_is_the_one_hot_special_case_of_rejection_sampling() -> None:
    generator = torch.Generator().manual_seed(8)
    rows, k, vocab = 64, 4, 9
    target_logits = torch.randn(rows, k + 1, vocab, generator=generator)
    draft_logits = target_logits[:, :k] + torch.randn(rows, k, vocab, generator=generator)
    drafts = draft_logits.argmax(dim=-1)
    expected, expected_accepted = greedy_verify(
        drafts, target_logits.argmax(dim=-1), torch.full((rows,), k)
    )
    q = probabilities(_rows(draft_logits), _params(rows * k, 0.0)).reshape(rows, k, vocab)
    p = probabilities(_rows(target_logits), _params(rows * (k + 1), 0.0)).reshape(
        rows, k + 1, vocab
    )
    output, accepted = rejection_sample(
        drafts,
        q,
        p,
        [torch.Generator().manual_seed(i) for i in range(rows)],
    )
    assert torch.equal(output, expected) and torch.equal(accepted, expected_accepted)
    assert 0 < int(accepted.sum()) < rows * k


def test_num_draft_limits_each_row() -> None:
    p = torch.full((2, 4, 5), 0.2)
    output, accepted = rejection_sample(
        torch.zeros((2, 3), dtype=torch.long), p[:, :3], p, [None, None], torch.tensor([1, 0])
    )
    assert accepted.tolist() == [1, 0]  # p == q: every proposed token is accepted
    assert (output[0, 2:] == -1).all() and (output[1, 1:] == -1).all()


def test_rows_without_drafts_sample_from_the_target() -> None:
    """num_draft = 0 is target-only decoding: the token comes from p."""
    rows, vocab = 20000, 7
    p = torch.softmax(torch.randn(1, vocab, generator=torch.Generator().manual_seed(9)), dim=-1)
    torch.manual_seed(10)
    output, accepted = rejection_sample(
        torch.zeros((rows, 0), dtype=torch.long),
        torch.zeros((rows, 0, vocab)),
        p.expand(rows, 1, vocab),
        [None] * rows,
    )
    assert output.shape == (rows, 1) and int(accepted.sum()) == 0
    assert _chi_square_p(output[:, 0], p[0]) > 0.01


@pytest.mark.parametrize("temperature", [1e-38, 1e-30, 1e-9, SAMPLING_EPS / 2])
def test_temperatures_below_the_floor_are_greedy(temperature: float) -> None:
    logits = torch.tensor([[3.0, 90.0, 89.9999, -1e4]])
    params = _params(1, temperature)
    assert params.all_greedy
    probs = probabilities(logits, params)
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


@pytest.mark.parametrize("temperature", [SAMPLING_EPS, 1e-4, 1e-2, 1.0, 50.0, 1e30])
def test_every_temperature_above_the_floor_gives_a_finite_distribution(
    temperature: float,
) -> None:
    logits = torch.tensor([[3.0, 90.0, 89.9, -1e4, 0.0]]) * 100  # large logits
    probs = probabilities(logits, _params(1, temperature))
    assert bool(finite_rows(probs).all())
    assert float(probs.sum()) == pytest.approx(1.0, abs=1e-5)
    token = torch.multinomial(probs, 1)
    assert 0 <= int(token) < 5


def test_non_finite_rows_are_flagged_and_made_safe() -> None:
    logits = torch.randn(3, 6)
    logits[1, 2] = float("nan")
    logits[2] = float("inf")
    probs = probabilities(logits, _params(3, 0.9))
    ok = finite_rows(probs)
    assert ok.tolist() == [True, False, False]
    safe = sanitize(probs, ok)
    assert torch.equal(safe[0], probs[0])
    tokens = torch.multinomial(safe, 1)  # would raise on the NaN rows
    assert tokens[1:].flatten().tolist() == [0, 0]


def test_draft_confidence_is_the_probability_of_the_drafted_token() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    greedy = SamplingTensors.build([0.0, 0.0], [0, 0], [1.0, 1.0], CPU)
    tokens, probs = draft_sample(logits, greedy, [None, None])
    assert probs is None
    expected = torch.softmax(logits, dim=-1).max(dim=-1).values
    assert torch.allclose(draft_confidence(logits, tokens, probs, greedy), expected)


def test_draft_confidence_reads_q_for_sampled_rows_and_softmax_for_greedy_ones() -> None:
    """A greedy row's q is one-hot; its confidence must not depend on its companions."""
    logits = torch.tensor([[0.0, 2.0, 1.0], [0.0, 2.0, 1.0]])
    mixed = SamplingTensors.build([0.0, 0.5], [0, 0], [1.0, 1.0], CPU)
    tokens = torch.tensor([1, 2])
    probs = probabilities(logits, mixed)
    confidence = draft_confidence(logits, tokens, probs, mixed)
    assert confidence[0] == pytest.approx(float(torch.softmax(logits[0], dim=-1)[1]))
    assert confidence[1] == pytest.approx(float(torch.softmax(logits[1] / 0.5, dim=-1)[2]))
