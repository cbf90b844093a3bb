"""The per-request logits-processing hook: the same processing for draft and target.

Processors here depend on the context each position really has (the
committed output plus the drafts before it), as penalties and grammars do.
Speculative greedy output must equal target-only greedy output under the
same processors, whatever the depth and the batch.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from tools.tiny_models import TinyPair, as_loaded, build_pair

from specpair_runtime.config import SpeculationKnobs
from specpair_runtime.engine.api import LogitsProcessor, SamplingParams
from specpair_runtime.engine.speculative import GenerationResult, SpeculativeEngine, generate

NEW = 24
TEXTS = ["Hello, how can I help", "My order has not", "The refund will"]


class NoRepeat:
    """Bans the token before each position, and one fixed token everywhere.

    Records what the target committed, and every context it was asked about.
    """

    def __init__(self, banned: int) -> None:
        self.banned = banned
        self.committed: list[int] = []
        self.contexts: list[tuple[int, ...]] = []
        self.calls = 0

    def process(self, proposed: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        first = len(proposed) - logits.shape[0] + 1  # the proposals row 0 follows
        for i in range(logits.shape[0]):
            context = [*self.committed, *proposed[: first + i]]
            self.contexts.append(tuple(context))
            logits[i, self.banned] = float("-inf")
            if context:
                logits[i, context[-1]] = float("-inf")
        return logits

    def commit(self, tokens: Sequence[int]) -> None:
        self.committed += tokens


@pytest.fixture(scope="module")
def pair() -> TinyPair:
    return build_pair("llama", seed=0)


def _engine(pair: TinyPair, knobs: SpeculationKnobs | None) -> SpeculativeEngine:
    tok = pair.tokenizer
    draft = as_loaded(pair.draft, tok, "draft") if knobs is not None else None
    return SpeculativeEngine(
        as_loaded(pair.target, tok, "target"), draft, knobs or SpeculationKnobs()
    )


def _run(
    pair: TinyPair, knobs: SpeculationKnobs | None, banned: int
) -> tuple[list[GenerationResult], list[NoRepeat]]:
    made: list[NoRepeat] = []

    def factory() -> LogitsProcessor:
        made.append(NoRepeat(banned))
        return made[-1]

    prompts = [pair.tokenizer(t)["input_ids"] for t in TEXTS]
    params = SamplingParams(max_new_tokens=NEW, logits_processors=(factory,))
    plain = SamplingParams(max_new_tokens=NEW)
    # The middle request has no processors: its batch-mates' processing must not reach it.
    return generate(_engine(pair, knobs), prompts, [params, plain, params]), made


def test_speculation_under_context_dependent_processors_keeps_greedy_output(
    pair: TinyPair,
) -> None:
    prompts = [pair.tokenizer(t)["input_ids"] for t in TEXTS]
    unprocessed = generate(_engine(pair, None), prompts, SamplingParams(max_new_tokens=NEW))
    banned = Counter(t for r in unprocessed for t in r.token_ids).most_common(1)[0][0]
    reference, _ = _run(pair, None, banned)
    expected = [r.token_ids for r in reference]
    assert expected[1] == unprocessed[1].token_ids  # no processors, no change
    assert expected[0] != unprocessed[0].token_ids  # the processors changed something
    for depth in (1, 3, 5):
        knobs = SpeculationKnobs(max_depth=depth, min_depth=depth, adaptive=False)
        results, processors = _run(pair, knobs, banned)
        assert [r.token_ids for r in results] == expected, f"depth {depth}"
        for result, processor in zip([results[0], results[2]], processors, strict=True):
            tokens = result.token_ids
            assert banned not in tokens
            assert all(a != b for a, b in itertools.pairwise(tokens))
            # State advanced on committed tokens only ...
            assert processor.committed == tokens
            # ... while positions after rejected drafts were processed in their context,
            assert any(c != tuple(tokens[: len(c)]) for c in processor.contexts)
            # and the draft's proposals went through the processor too (a call per
            # draft forward, beside one per verify).
            stats = result.stats
            assert stats.drafted_tokens > 0
            assert processor.calls >= stats.target_passes + stats.speculation_steps
