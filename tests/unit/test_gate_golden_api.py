"""The gate's judgement of an engine's output from the target's prompt log-probabilities."""

from __future__ import annotations

from typing import Any

from specpair_runtime.sidecar.golden_api import judge, near_tie_margin


def entry(chosen: int, logprob: float, rank: int, top: tuple[int, float] | None = None) -> Any:
    found = {str(chosen): {"logprob": logprob, "rank": rank, "decoded_token": f"t{chosen}"}}
    if top is not None:
        found[str(top[0])] = {"logprob": top[1], "rank": 1, "decoded_token": f"t{top[0]}"}
    return found


def test_every_token_the_targets_top_choice_passes() -> None:
    scores = [None, entry(5, -1.0, 1), entry(7, -0.2, 1), entry(9, -0.5, 1)]
    assert judge(2, [7, 9], scores, margin=0.0).problem is None


def test_a_token_the_target_ranks_second_fails_with_both_tokens_and_the_gap() -> None:
    scores = [None, entry(5, -1.0, 1), entry(7, -2.5, 2, top=(8, -0.5))]
    verdict = judge(2, [7], scores, margin=0.5)
    assert verdict.problem == (
        "position 0: the engine emitted 't7' (7) where the target's greedy choice is "
        "'t8' (8), 2.0000 logits below it (nearTieMargin 0.5)"
    )


def test_a_near_tie_is_noted_and_ends_the_comparison() -> None:
    scores = [None, entry(5, -1.0, 1), entry(7, -0.70, 2, top=(8, -0.69)), entry(3, -9.0, 50)]
    verdict = judge(2, [7, 3], scores, margin=0.5)
    assert verdict.problem is None and verdict.note is not None
    assert "a near-tie (margin 0.5); not compared further" in verdict.note


def test_the_default_margin_is_small_on_the_cpu() -> None:
    assert near_tie_margin(None, cuda=False) == 0.05
    assert near_tie_margin(None, cuda=True) == 0.5
    assert near_tie_margin(0.1, cuda=True) == 0.1
