"""Grammar compilation (cache, worker threads, errors) and the per-request speculative state."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
import torch
from tools.tiny_models import build_tokenizer
from transformers import PreTrainedTokenizerFast

from specpair_runtime.engine import token_bitmask
from specpair_runtime.engine.grammar import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
)
from specpair_runtime.engine.grammar_state import GrammarState, GrammarViolation

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    },
    "required": ["answer", "items"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer: PreTrainedTokenizerFast) -> Iterator[GrammarCompiler]:
    compiler = GrammarCompiler(tokenizer, len(tokenizer) + 8, [tokenizer.eos_token_id])
    yield compiler
    compiler.close()


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def allowed(state: GrammarState, after: int, vocab: int) -> set[int]:
    return set(token_bitmask.allowed_tokens(state.mask(after), vocab).nonzero()[:, 0].tolist())


def test_a_schema_allows_exactly_its_documents(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerFast
) -> None:
    compiled = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    good = encode(tokenizer, json.dumps({"answer": "no", "items": [1, 22]}))
    state = GrammarState(compiled, compiler.vocab_size)
    state.commit(good)  # every token is allowed on the way
    assert state.accepting
    assert allowed(state, 0, compiler.vocab_size) == {tokenizer.eos_token_id}
    other = GrammarState(compiled, compiler.vocab_size)
    with pytest.raises(GrammarViolation):
        other.commit(encode(tokenizer, '{"answer": "maybe"'))


def test_padding_ids_past_the_tokenizer_are_never_allowed(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerFast
) -> None:
    state = GrammarState(compiler.compile(GrammarSpec.regex(".*")), compiler.vocab_size)
    tokens = allowed(state, 0, compiler.vocab_size)
    assert tokens and max(tokens) < len(tokenizer)


@pytest.mark.parametrize(
    ("spec", "text"),
    [
        (GrammarSpec.choice(["positive", "negative"]), "negative"),
        (GrammarSpec.regex(r"\d{3}-[a-z]+"), "123-abc"),
        (GrammarSpec.json_object(), '{"a": [1, 2], "b": {"c": null}}'),
        (GrammarSpec.lark('start: "one" | "two" " " "three"'), "two three"),
    ],
    ids=["choice", "regex", "json_object", "lark"],
)
def test_each_kind_accepts_a_match(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerFast, spec: GrammarSpec, text: str
) -> None:
    state = GrammarState(compiler.compile(spec), compiler.vocab_size)
    state.commit(encode(tokenizer, text))
    assert state.accepting


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GrammarSpec.json_schema({"type": "strin"}), "strin"),
        (GrammarSpec.json_schema({"$ref": "#/$defs/missing"}), "missing"),
        (GrammarSpec.regex("a(b"), "unclosed group"),
        (GrammarSpec.choice([]), "empty"),
        (GrammarSpec("json_schema", "{not json"), "not JSON"),
        (GrammarSpec.lark("start: undefined_rule"), "undefined_rule"),
    ],
)
def test_a_grammar_that_cannot_compile_names_the_problem(
    compiler: GrammarCompiler, spec: GrammarSpec, message: str
) -> None:
    with pytest.raises(GrammarError, match=message):
        compiler.compile(spec)
    with pytest.raises(GrammarError, match=message):
        compiler.compile_async(spec).result(timeout=30)


def test_compiles_are_cached_per_spec(tokenizer: PreTrainedTokenizerFast) -> None:
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], cache_size=2)
    try:
        a, b, c = (GrammarSpec.regex(p) for p in ("a+", "b+", "c+"))
        first = compiler.compile(a)
        assert compiler.compile(a) is first
        assert compiler.compile_async(a).result() is first
        compiler.compile(b)
        compiler.compile(c)  # evicts a, the least recently used
        assert compiler.compiles == 3
        assert compiler.compile(a) is not first and compiler.compiles == 4
    finally:
        compiler.close()


def test_concurrent_requests_for_one_spec_share_one_compile(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    try:
        spec = GrammarSpec.json_schema({**SCHEMA, "title": "shared"})
        futures = [compiler.compile_async(spec) for _ in range(8)]
        results = {id(f.result(timeout=30)) for f in futures}
        assert len(results) == 1 and compiler.compiles == 1
    finally:
        compiler.close()


def test_a_slow_compile_does_not_block_the_caller(tokenizer: PreTrainedTokenizerFast) -> None:
    """compile_async returns at once; the compile runs on a worker thread."""
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    release = threading.Event()
    build = compiler._build

    def slow(spec: GrammarSpec):  # type: ignore[no-untyped-def]
        release.wait(30)
        return build(spec)

    compiler._build = slow  # type: ignore[method-assign]
    try:
        start = time.monotonic()
        slow_future = compiler.compile_async(GrammarSpec.regex("slow"))
        assert time.monotonic() - start < 1.0 and not slow_future.done()
        # Another spec compiles on the second worker meanwhile.
        compiler._build = build  # type: ignore[method-assign]
        other = compiler.compile_async(GrammarSpec.regex("fast")).result(timeout=30)
        assert other.spec == GrammarSpec.regex("fast") and not slow_future.done()
        release.set()
        assert slow_future.result(timeout=30).spec == GrammarSpec.regex("slow")
    finally:
        release.set()
        compiler.close()


def test_rejected_proposals_never_advance_the_grammar(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerFast
) -> None:
    """Masks after align + commit equal those of a state that saw only the committed tokens."""
    compiled = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    vocab = compiler.vocab_size
    text = encode(tokenizer, '{"answer": "yes", "items": [7]}')
    speculative = GrammarState(compiled, vocab)
    plain = GrammarState(compiled, vocab)
    position = 0
    while position + 3 <= len(text):
        drafts = text[position : position + 3]
        # As the drafter proposes: one more tentative token per forward.
        for j in range(4):
            assert speculative.align(drafts[:j]) == j
            speculative.mask(j)
        masks = torch.stack([speculative.mask(j) for j in range(4)])
        # The verify masks are the masks of the plain state after each draft.
        for j in range(4):
            probe = GrammarState(compiled, vocab)
            probe.commit(text[: position + j])
            assert torch.equal(masks[j], probe.mask(0)), j
        # One accepted draft, then a recovered token (the true next one).
        speculative.commit([drafts[0], drafts[1]])
        plain.commit(drafts[:2])
        position += 2
        assert speculative.proposed == 0
        assert torch.equal(speculative.mask(0), plain.mask(0))


def test_a_refused_proposal_is_not_consumed(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerFast
) -> None:
    state = GrammarState(compiler.compile(GrammarSpec.choice(["yes"])), compiler.vocab_size)
    no = encode(tokenizer, "no")[0]
    assert state.align([no, no]) == 0
    assert state.proposed == 0
    yes = encode(tokenizer, "yes")
    assert state.align([*yes, no]) == len(yes)  # stops before the refused token
    state.commit(yes)
    assert state.stopped and state.accepting


def test_a_mask_asked_out_of_order_is_recomputed(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerFast
) -> None:
    compiled = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    text = encode(tokenizer, '{"answer": "no"')
    state = GrammarState(compiled, compiler.vocab_size)
    state._matcher.consume_tokens(text[:3])  # tentative tokens whose masks were never asked
    state._tokens = list(text[:3])
    probe = GrammarState(compiled, compiler.vocab_size)
    probe.commit(text[:1])
    assert torch.equal(state.mask(1), probe.mask(0))
    assert state.proposed == 3
    state.commit(text[:3])
    probe.commit(text[1:3])
    assert torch.equal(state.mask(0), probe.mask(0))


def test_a_shorter_proposal_rolls_back(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerFast
) -> None:
    compiled = compiler.compile(GrammarSpec.json_schema(SCHEMA))
    text = encode(tokenizer, '{"answer": "no"')
    state = GrammarState(compiled, compiler.vocab_size)
    first = state.mask(0).clone()
    state.align(text[:4])
    assert state.align(text[:1]) == 1
    state.commit([])
    assert torch.equal(state.mask(0), first)


def test_end_of_generation_is_allowed_once_the_grammar_accepts(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerFast
) -> None:
    state = GrammarState(compiler.compile(GrammarSpec.regex("a+")), compiler.vocab_size)
    assert tokenizer.eos_token_id not in allowed(state, 0, compiler.vocab_size)
    state.commit(encode(tokenizer, "a"))
    assert tokenizer.eos_token_id in allowed(state, 0, compiler.vocab_size)
    state.commit([tokenizer.eos_token_id])


def test_a_cancelled_compile_is_started_again(tokenizer: PreTrainedTokenizerFast) -> None:
    """A compile cancelled before it ran (shutdown) does not stay pending for its spec."""
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    try:
        spec = GrammarSpec.regex("x+")
        stale: Future[CompiledGrammar] = Future()
        stale.cancel()
        compiler._pending[spec] = stale
        assert compiler.compile_async(spec).result(timeout=30).spec == spec
    finally:
        compiler.close()
