"""End to end: speculative sampling keeps the target's processed distribution.

Many requests decode the same prompt in large batches. The first generated
token is sampled at the end of the prompt's prefill; the next ones come out
of one speculation step of depth 2 (accepted, recovered and bonus tokens all
occur). The frequencies of the first and second tokens are compared with the
target's processed distribution, computed independently with transformers'
logits warpers. Chi-square, p > 0.01, fixed seeds. Seeded requests take the
Gumbel-max coupling (``sampling.coupled_tokens``), one seed each; unseeded
ones the rejection sampler, on torch's global generator.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from tools.tiny_models import as_loaded, build_pair
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specpair_runtime.config import SpeculationKnobs
from specpair_runtime.engine.api import SamplingParams
from specpair_runtime.engine.options import EngineOptions
from specpair_runtime.engine.speculative import SpeculativeEngine, generate

SAMPLES = 4000
BATCH = 500
# A draft-confidence threshold at which the tiny draft is sometimes sure, sometimes not.
CUTS_SOME = 0.3
PROMPT = "Thank you for your patience. Is there"
UNSEEDED = -1  # a parameter's seed that asks for unseeded requests


def _processed(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The reference: HF warpers (temperature, top-k, top-p) then softmax, float64."""
    scores = TemperatureLogitsWarper(params.temperature)(None, logits.double())
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    probs: torch.Tensor = scores.softmax(dim=-1)
    return probs


def _p_value(samples: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
    expected = probs * len(samples)
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    wanted = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    if wanted[-1] < 1:  # negligible tail: fold it into the last big category
        observed[-2] += observed[-1]
        wanted[-2] += wanted[-1]
        observed, wanted = observed[:-1], wanted[:-1]
    wanted = wanted * observed.sum() / wanted.sum()
    return float(chisquare(observed.numpy(), wanted.numpy()).pvalue)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("params", "independent_draft", "draft_confidence"),
    [
        # Unseeded: the rejection sampler (min(1, p/q), the residual, the bonus token).
        (SamplingParams(max_new_tokens=4, temperature=1.0, seed=-1), False, 0.0),
        (SamplingParams(max_new_tokens=4, temperature=1.0), False, 0.0),
        (SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9), False, 0.0),
        (SamplingParams(max_new_tokens=4, temperature=1.5, top_k=8), False, 0.0),
        (SamplingParams(max_new_tokens=4, temperature=1.0), True, 0.0),  # disagreeing draft
        # Rows stop drafting where the draft is unsure of its token (some after one).
        (SamplingParams(max_new_tokens=4, temperature=1.0), False, CUTS_SOME),
    ],
    ids=[
        "unseeded-t1",
        "t1",
        "t0.7-top_p0.9",
        "t1.5-top_k8",
        "disagreeing-draft",
        "confidence-stop",
    ],
)
def test_first_tokens_follow_the_target_distribution(
    params: SamplingParams, independent_draft: bool, draft_confidence: float
) -> None:
    pair = build_pair("llama", seed=0, independent_draft=independent_draft)
    tok = pair.tokenizer
    prompt = tok(PROMPT)["input_ids"]
    engine = SpeculativeEngine(
        as_loaded(pair.target, tok, "target"),
        as_loaded(pair.draft, tok, "draft"),
        SpeculationKnobs(
            max_depth=2, min_depth=2, adaptive=False, draft_confidence=draft_confidence
        ),
        options=EngineOptions(max_slots=BATCH, max_length=64, max_step_tokens=BATCH * 16),
    )
    torch.manual_seed(1234)
    firsts: list[int] = []
    seconds: list[int] = []
    drafted = accepted = steps = 0
    for start in range(0, SAMPLES, BATCH):
        batch = [
            SamplingParams(
                max_new_tokens=params.max_new_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                seed=None if params.seed == UNSEEDED else start + i,
            )
            for i in range(BATCH)
        ]
        for result in generate(engine, [prompt] * BATCH, batch):
            firsts.append(result.token_ids[0])
            seconds.append(result.token_ids[1])
            drafted += result.stats.drafted_tokens
            accepted += result.stats.accepted_tokens
            steps += result.stats.speculation_steps

    with torch.inference_mode():
        p1 = _processed(pair.target(torch.tensor([prompt])).logits[0, -1:], params)[0]
        support = p1.nonzero().flatten()
        contexts = torch.tensor([[*prompt, int(x)] for x in support])
        p2_given = _processed(pair.target(contexts).logits[:, -1], params)
        p2 = (p1[support][:, None] * p2_given).sum(dim=0)  # marginal of the 2nd token

    rate = accepted / drafted
    assert 0.0 < rate < 1.0
    if independent_draft:
        assert rate < 0.35
    if draft_confidence:  # the stop really cut some rows short, not all
        assert steps < drafted < 2 * steps
    assert _p_value(firsts, p1) > 0.01
    assert _p_value(seconds, p2) > 0.01
