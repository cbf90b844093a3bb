"""Speculative sampling keeps the target's constrained and penalised distributions.

The chi-square harness of ``test_speculative_statistics.py`` with logits
processors: a grammar that allows a handful of phrases, and presence,
frequency and repetition penalties. The first two sampled tokens are compared
with the target's processed distribution, computed here independently: the
grammar's masks from a matcher that sees only the tokens before each position,
the penalties written out as formulas.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from tools.tiny_models import TinyPair, as_loaded, build_pair

from specpair_runtime.config import SpeculationKnobs
from specpair_runtime.engine import token_bitmask
from specpair_runtime.engine.api import SamplingParams
from specpair_runtime.engine.constraint_processors import processor_factories
from specpair_runtime.engine.grammar import CompiledGrammar, GrammarCompiler, GrammarSpec
from specpair_runtime.engine.grammar_state import GrammarState
from specpair_runtime.engine.options import EngineOptions
from specpair_runtime.engine.penalties import Penalties
from specpair_runtime.engine.speculative import SpeculativeEngine, generate
from tests.integration.test_speculative_statistics import BATCH, PROMPT, SAMPLES, _p_value

pytestmark = [pytest.mark.slow]

PHRASES = ["Thank you", "Thanks a lot", "the refund", "the order is here", "yes", "you can"]
PENALTIES = Penalties.of(presence=0.6, frequency=0.8, repetition=1.4)


def _sample(
    pair: TinyPair, prompt: list[int], grammar: CompiledGrammar | None, penalties: Penalties
) -> tuple[list[list[int]], float]:
    """The first three tokens of SAMPLES seeded requests, and the acceptance rate."""
    tok = pair.tokenizer
    engine = SpeculativeEngine(
        as_loaded(pair.target, tok, "target"),
        as_loaded(pair.draft, tok, "draft"),
        SpeculationKnobs(max_depth=2, min_depth=2, adaptive=False, draft_confidence=0.0),
        options=EngineOptions(max_slots=BATCH, max_length=64, max_step_tokens=BATCH * 16),
    )
    factories = processor_factories(grammar, penalties, prompt)
    torch.manual_seed(4321)
    tokens: list[list[int]] = []
    drafted = accepted = 0
    for start in range(0, SAMPLES, BATCH):
        batch = [
            SamplingParams(
                max_new_tokens=3, temperature=1.0, seed=start + i, logits_processors=factories
            )
            for i in range(BATCH)
        ]
        for result in generate(engine, [prompt] * BATCH, batch):
            tokens.append(result.token_ids[:3])
            drafted += result.stats.drafted_tokens
            accepted += result.stats.accepted_tokens
    return tokens, accepted / drafted


def _masked(logits: torch.Tensor, grammar: CompiledGrammar, history: list[int]) -> torch.Tensor:
    state = GrammarState(grammar, logits.shape[-1])
    state.commit(history)
    allowed = token_bitmask.allowed_tokens(state.mask(0), logits.shape[-1])
    return logits.masked_fill(~allowed, float("-inf"))


def _penalised(logits: torch.Tensor, prompt: list[int], output: list[int]) -> torch.Tensor:
    out = logits.clone()
    for token in set(prompt) | set(output):
        r = PENALTIES.repetition
        out[token] = out[token] / r if out[token] > 0 else out[token] * r
    for token in set(output):
        out[token] -= PENALTIES.frequency * output.count(token) + PENALTIES.presence
    return out


@pytest.mark.parametrize("kind", ["constrained-choice", "penalised"])
def test_first_tokens_follow_the_processed_target_distribution(kind: str) -> None:
    """Tokens 1 and 2 (a prefill's, then a verify's first position) and token 3.

    Token 3 is the verify's second position when the first draft is accepted:
    its counts include that draft, which is where within-step counting shows.
    """
    pair = build_pair("llama", seed=0)
    tok = pair.tokenizer
    prompt = list(tok(PROMPT)["input_ids"])
    compiler = GrammarCompiler(tok, pair.target.config.vocab_size, [tok.eos_token_id])
    try:
        grammar = compiler.compile(GrammarSpec.choice(PHRASES)) if kind != "penalised" else None
        penalties = PENALTIES if kind == "penalised" else Penalties()
        sampled, rate = _sample(pair, prompt, grammar, penalties)

        def process(logits: torch.Tensor, history: list[int]) -> torch.Tensor:
            if grammar is not None:
                return _masked(logits, grammar, history)
            return _penalised(logits, prompt, history)

        marginals = _marginals(pair, prompt, process, steps=3)
    finally:
        compiler.close()
    assert 0.0 < rate < 1.0
    if grammar is not None:  # the constraint really bites: few first tokens are possible
        support = marginals[0].nonzero().flatten().tolist()
        assert len(support) < 20 and {t[0] for t in sampled} <= set(support)
    for position, marginal in enumerate(marginals):
        observed = [t[position] for t in sampled if len(t) > position]
        assert _p_value(observed, marginal) > 0.01, position


Processor = Callable[[torch.Tensor, list[int]], torch.Tensor]


def _marginals(
    pair: TinyPair, prompt: list[int], process: Processor, steps: int
) -> list[torch.Tensor]:
    """The target's processed marginal of each of the first ``steps`` tokens (float64).

    Exact over every history whose probability is at least ``1e-7``; what is
    left out is checked to be under ``1e-3`` of the mass.
    """
    histories: list[tuple[list[int], float]] = [([], 1.0)]
    marginals = []
    with torch.inference_mode():
        for _ in range(steps):
            contexts = torch.tensor([[*prompt, *h] for h, _ in histories])
            raw = pair.target(contexts).logits[:, -1].double()
            probs = torch.stack(
                [process(raw[i], h).softmax(dim=-1) for i, (h, _) in enumerate(histories)]
            )
            weights = torch.tensor([w for _, w in histories], dtype=torch.float64)
            joint = weights[:, None] * probs
            marginals.append(joint.sum(dim=0))
            if len(marginals) == steps:
                break
            keep = (joint >= 1e-7).nonzero().tolist()
            histories = [([*histories[i][0], t], float(joint[i, t])) for i, t in keep]
            assert sum(w for _, w in histories) > 1 - 1e-3
    return marginals
