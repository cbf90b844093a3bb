"""Grammar and penalty processors called as the speculative engine calls them.

The property that keeps speculation lossless: the logits a verify position
gets equal the logits target-only decoding would get at that position had
the drafts before it been sampled, and a draft forward sees the same. The
test drives each processor through random speculative steps (drafter calls
with growing proposals, then a verify call, then a commit of an accepted
prefix plus one token) and compares every position with a fresh processor
that only ever saw committed tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch
from tools.tiny_models import build_tokenizer
from transformers import PreTrainedTokenizerFast

from specpair_runtime.engine.constraint_processors import GrammarProcessor, PenaltyProcessor
from specpair_runtime.engine.grammar import GrammarCompiler, GrammarSpec
from specpair_runtime.engine.penalties import Penalties

Processor = GrammarProcessor | PenaltyProcessor

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "tags", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer: PreTrainedTokenizerFast) -> Iterator[GrammarCompiler]:
    compiler = GrammarCompiler(tokenizer, len(tokenizer) + 4, [tokenizer.eos_token_id])
    yield compiler
    compiler.close()


def target_only(
    build: Callable[[], Processor], history: Sequence[int], logits: torch.Tensor
) -> torch.Tensor:
    """What a processor that saw ``history`` committed one token at a time makes of ``logits``."""
    processor = build()
    for token in history:
        processor.commit([token])
    return processor.process([], logits[None].clone())[0]


def pick(logits: torch.Tensor, generator: random.Random) -> int:
    """A token the processed logits allow, at random."""
    allowed: list[int] = torch.isfinite(logits).nonzero()[:, 0].tolist()
    return generator.choice(allowed)


def run_speculation(
    build: Callable[[], Processor], vocab: int, steps: int, seed: int, end_ids: frozenset[int]
) -> int:
    """Random speculative steps; asserts every position against target-only. Returns tokens."""
    generator = random.Random(seed)
    torch.manual_seed(seed)
    processor = build()
    history: list[int] = []
    for _ in range(steps):
        depth = generator.randint(0, 4)
        proposed: list[int] = []
        refused = False
        for j in range(depth):  # the drafter: one position after j proposals
            logits = torch.randn(1, vocab) * 3
            out = processor.process(proposed, logits.clone())[0]
            if refused:  # past a refused proposal the logits are left alone
                assert torch.equal(out, logits[0]), ("draft", j)
            else:
                expected = target_only(build, history + proposed, logits[0])
                assert torch.equal(out, expected), ("draft", j)
            # Now and then a token the processed logits forbid (a sanitized draft row).
            token = pick(out, generator) if generator.random() < 0.9 else 0
            refused = refused or not torch.isfinite(out[token])
            proposed.append(token)
        logits = torch.randn(depth + 1, vocab) * 3
        verified = processor.process(proposed, logits.clone())
        # Positions up to the first draft the grammar refuses are used; later ones never.
        usable = next(
            (i for i, t in enumerate(proposed) if not torch.isfinite(verified[i, t])), depth
        )
        for i in range(usable + 1):
            expected = target_only(build, history + proposed[:i], logits[i])
            assert torch.equal(verified[i], expected), ("verify", i)
        accepted = generator.randint(0, usable)
        tokens = [*proposed[:accepted], pick(verified[accepted], generator)]
        processor.commit(tokens)
        history += tokens
        if any(t in end_ids for t in tokens):
            break
    return len(history)


def test_grammar_masks_match_target_only_at_every_position(compiler: GrammarCompiler) -> None:
    compiled = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    for seed in range(6):
        produced = run_speculation(
            lambda: GrammarProcessor(compiled),
            compiler.vocab_size,
            steps=40,
            seed=seed,
            end_ids=frozenset(compiled.end_ids),
        )
        assert produced > 5


def test_penalties_match_target_only_at_every_position(tokenizer: PreTrainedTokenizerFast) -> None:
    penalties = Penalties.of(
        presence=0.7, frequency=0.4, repetition=1.2, logit_bias={3: 2.0, 9: -5.0}
    )
    for seed in range(4):
        run_speculation(
            lambda: PenaltyProcessor(penalties, prompt_ids=[1, 2, 3, 5, 8]),
            len(tokenizer),
            steps=15,
            seed=seed,
            end_ids=frozenset(),
        )


def test_after_the_end_token_nothing_is_constrained(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerFast
) -> None:
    """ignore_eos decodes past the end: the grammar has ended and masks nothing more."""
    processor = GrammarProcessor(compiler.compile(GrammarSpec.choice(["yes"])))
    processor.commit(list(tokenizer("yes", add_special_tokens=False).input_ids))
    logits = torch.zeros(1, compiler.vocab_size)
    allowed = torch.isfinite(processor.process([], logits.clone())).nonzero()[:, 1].tolist()
    assert allowed == [tokenizer.eos_token_id]
    processor.commit([tokenizer.eos_token_id, 5])
    assert torch.equal(processor.process([], logits.clone()), logits)


def test_a_draft_the_grammar_refuses_leaves_the_later_positions_alone(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerFast
) -> None:
    processor = GrammarProcessor(compiler.compile(GrammarSpec.choice(["yes"])))
    no = tokenizer("no", add_special_tokens=False).input_ids[0]
    logits = torch.zeros(2, compiler.vocab_size)
    out = processor.process([no], logits.clone())
    assert not torch.isfinite(out[0, no])  # the target rejects the draft there
    assert torch.equal(out[1], logits[1])


def test_positions_need_their_proposals(compiler: GrammarCompiler) -> None:
    processor = GrammarProcessor(compiler.compile(GrammarSpec.regex("a+")))
    with pytest.raises(ValueError, match="at least 2 proposed"):
        processor.process([1], torch.zeros(3, compiler.vocab_size))
