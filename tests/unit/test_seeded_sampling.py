"""Seeded sampling: exponential-race (Gumbel-max) tokens keyed by (seed, position), as p."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from specpair_runtime.engine.sampling import coupled_tokens, race_noise

CPU = torch.device("cpu")


def test_the_noise_is_a_function_of_seed_and_position_alone() -> None:
    a = race_noise(7, 3, 50, CPU)
    assert torch.equal(a, race_noise(7, 3, 50, CPU))
    assert not torch.equal(a, race_noise(7, 4, 50, CPU))
    assert not torch.equal(a, race_noise(8, 3, 50, CPU))
    assert not torch.equal(race_noise(0, 1, 50, CPU), race_noise(1, 0, 50, CPU))
    noise = race_noise(2**63 - 1, 10**9, 50, CPU)
    assert torch.isfinite(noise).all() and (noise > 0).all()


def test_coupled_tokens_follow_the_distribution_over_seeds() -> None:
    probs = torch.tensor([[0.4, 0.25, 0.15, 0.1, 0.06, 0.04, 0.0]])
    tokens = [int(coupled_tokens(probs, seed, 5)[0]) for seed in range(20000)]
    counts = torch.bincount(torch.tensor(tokens), minlength=7).double()
    assert counts[6] == 0  # probability 0 is never chosen
    expected = probs[0, :6].double() * len(tokens)
    assert chisquare(counts[:6].numpy(), expected.numpy()).pvalue > 0.01


def test_the_same_noise_couples_two_close_distributions() -> None:
    """Draft and target pick the same token most of the time when q is close to p."""
    p = torch.softmax(torch.randn(4, 40, generator=torch.Generator().manual_seed(1)), dim=-1)
    q = torch.softmax(
        p.log() + 0.1 * torch.randn(4, 40, generator=torch.Generator().manual_seed(2)), dim=-1
    )
    same = sum(
        int((coupled_tokens(p, seed, 0) == coupled_tokens(q, seed, 0)).sum()) for seed in range(500)
    )
    assert same / 2000 > 0.8
