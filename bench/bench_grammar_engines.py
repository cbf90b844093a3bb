"""What each grammar engine costs per decoding step on the CPU, with the real tokenizer.

Structured outputs mask the logits at every position the target verifies and
at every position the draft proposes, so the grammar engine runs on the
engine thread once per position and request. This measures the three
engines that issue 52 names, each against the real Qwen2.5 tokenizer
(151,665 tokens, logits of 151,936):

- ``setup``: building the engine's tokenizer index (once per process);
- ``compile``: one JSON schema with nested objects, arrays, enums and
  required fields, cold (once per schema; the runtime caches it);
- ``mask``: one next-token bitmask, per position of a walk through a valid
  document of that schema (the document tokenized by the real tokenizer, so
  the walk takes the tokens a model would);
- ``advance``: consuming one token;
- ``rollback``: whether the matcher rolls back consumed tokens, checked by
  comparing the masks after consume-then-rollback with the masks before.

It runs whichever of ``llguidance``, ``xgrammar`` and ``outlines_core`` is
importable, so each can be measured in its own virtual environment beside
the runtime's torch and transformers:

    python3.11 -m venv /tmp/g && /tmp/g/bin/pip install torch==2.13.0 \\
        transformers==5.24.0 xgrammar==0.2.8
    /tmp/g/bin/python bench/bench_grammar_engines.py --tokenizer DIR [--rounds 5]

(``DIR``: ``~/.cache/specpair/models/qwen2.5-coder-0.5b-instruct`` after
``make models``.) The mask costs are medians over every position of every
round, with the 90th percentile; wall times on a shared machine are noisy,
so compare engines measured in the same window.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["engineer", "manager", "designer"]},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string"},
            },
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "skills": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "level": {"type": "integer"},
                },
                "required": ["name", "level"],
                "additionalProperties": False,
            },
        },
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "role", "address", "skills", "active"],
    "additionalProperties": False,
}

DOCUMENT: dict[str, Any] = {
    "name": "Ada Lovelace",
    "age": 36,
    "role": "engineer",
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
    "skills": [{"name": "analysis", "level": 5}, {"name": "poetry", "level": 3}],
    "active": True,
    "tags": ["mathematics", "computing", "notes on the analytical engine"],
}


@dataclass
class Matcher:
    """One engine's per-request state, behind the same four calls."""

    fill: Callable[[torch.Tensor], None]  # writes the next-token bitmask [1, W] int32
    advance: Callable[[int], bool]
    rollback: Callable[[int], None] | None


@dataclass
class Engine:
    name: str
    setup_seconds: float
    compile: Callable[[dict[str, Any]], Any]
    matcher: Callable[[Any], Matcher]


def _llguidance(tokenizer: PreTrainedTokenizerFast, vocab: int) -> Engine:
    import llguidance
    import llguidance.hf

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    setup = time.perf_counter() - start

    def compile_schema(schema: dict[str, Any]) -> Any:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
        error = llguidance.LLMatcher.validate_grammar(grammar, lltok)
        if error:
            raise ValueError(error)
        # The first matcher builds the lexer over the token trie: part of compiling.
        llguidance.LLMatcher(lltok, grammar)
        return grammar

    def matcher(grammar: Any) -> Matcher:
        m = llguidance.LLMatcher(lltok, grammar)

        def fill(mask: torch.Tensor) -> None:
            m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)

        def rollback(n: int) -> None:
            m.rollback(n)

        return Matcher(fill, m.consume_token, rollback)

    return Engine("llguidance", setup, compile_schema, matcher)


def _xgrammar(tokenizer: PreTrainedTokenizerFast, vocab: int) -> Engine:
    import xgrammar

    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    setup = time.perf_counter() - start

    def compile_schema(schema: dict[str, Any]) -> Any:
        return compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":"), strict_mode=True
        )

    def matcher(compiled: Any) -> Matcher:
        m = xgrammar.GrammarMatcher(compiled)

        def fill(mask: torch.Tensor) -> None:
            m.fill_next_token_bitmask(mask, 0)

        return Matcher(fill, m.accept_token, m.rollback)

    return Engine("xgrammar", setup, compile_schema, matcher)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _outlines_core(tokenizer: PreTrainedTokenizerFast, vocab: int) -> Engine:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema

    start = time.perf_counter()
    decoder = _byte_decoder()
    special = set(tokenizer.all_special_tokens)
    mapping: dict[bytes, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token in special:
            continue
        raw = (
            bytes(decoder[c] for c in token)
            if all(c in decoder for c in token)
            else token.encode("utf-8")
        )
        mapping.setdefault(raw, []).append(token_id)
    vocabulary = outlines_core.Vocabulary(tokenizer.eos_token_id, mapping)
    setup = time.perf_counter() - start

    def compile_schema(schema: dict[str, Any]) -> Any:
        regex = build_regex_from_schema(json.dumps(schema), whitespace_pattern="")
        return outlines_core.Index(regex, vocabulary)

    def matcher(index: Any) -> Matcher:
        guide = outlines_core.Guide(index, max_rollback=64)

        def fill(mask: torch.Tensor) -> None:
            guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)

        def advance(token: int) -> bool:
            if token == tokenizer.eos_token_id and guide.is_finished():
                return True  # the Guide ends in its final state; EOS is not a transition
            guide.advance(token)
            return True

        return Matcher(fill, advance, guide.rollback_state)

    return Engine("outlines_core", setup, compile_schema, matcher)


BUILDERS = {"llguidance": _llguidance, "xgrammar": _xgrammar, "outlines_core": _outlines_core}


def _popcount(mask: torch.Tensor) -> int:
    """Tokens the bitmask allows."""
    return int(sum(bin(word & 0xFFFFFFFF).count("1") for word in mask[0].tolist()))


def _allowed(mask: torch.Tensor, token: int) -> bool:
    return bool((int(mask[0, token // 32]) >> (token % 32)) & 1)


def _walk(engine: Engine, compiled: Any, tokens: list[int], words: int) -> dict[str, list[float]]:
    matcher = engine.matcher(compiled)
    mask = torch.zeros((1, words), dtype=torch.int32)
    fills, advances, allowed = [], [], []
    for position, token in enumerate(tokens):
        start = time.perf_counter()
        matcher.fill(mask)
        fills.append(time.perf_counter() - start)
        allowed.append(float(_popcount(mask)))
        if not _allowed(mask, token):
            raise AssertionError(f"{engine.name}: token {token} refused at position {position}")
        start = time.perf_counter()
        ok = matcher.advance(token)
        advances.append(time.perf_counter() - start)
        if not ok:
            raise AssertionError(f"{engine.name}: advance failed at position {position}")
    return {"mask": fills, "advance": advances, "allowed": allowed}


def _rolls_back(engine: Engine, compiled: Any, tokens: list[int], words: int) -> bool:
    """Consume 4 tokens past a point, roll them back: same mask as before."""
    matcher = engine.matcher(compiled)
    if matcher.rollback is None:
        return False
    before = torch.zeros((1, words), dtype=torch.int32)
    scratch = torch.zeros_like(before)
    for token in tokens[:10]:
        matcher.fill(scratch)
        matcher.advance(token)
    matcher.fill(before)
    for token in tokens[10:14]:
        matcher.fill(scratch)
        matcher.advance(token)
    matcher.rollback(4)
    again = torch.zeros_like(before)
    matcher.fill(again)
    return bool(torch.equal(before, again))


def _apply_cost(vocab: int, rows: int, repeats: int = 50) -> float:
    """Median seconds of unpacking a bitmask [rows, W] onto logits [rows, V] (pure torch)."""
    words = (vocab + 31) // 32
    logits = torch.randn(rows, vocab)
    mask = torch.randint(-(2**31), 2**31 - 1, (rows, words), dtype=torch.int32)
    shifts = torch.arange(32, dtype=torch.int32)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        bits = ((mask[:, :, None] >> shifts) & 1).view(rows, -1)[:, :vocab].bool()
        logits.masked_fill(~bits, float("-inf"))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _ms(values: list[float]) -> str:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return (
        f"{statistics.median(values) * 1e3:.3f} ms "
        f"(p90 {p90 * 1e3:.3f}, max {ordered[-1] * 1e3:.3f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    assert isinstance(tokenizer, PreTrainedTokenizerFast), "the engines need a fast tokenizer"
    vocab = int(json.loads((args.tokenizer / "config.json").read_text())["vocab_size"])
    words = (vocab + 31) // 32
    text = json.dumps(DOCUMENT, separators=(",", ":"))
    tokens = [*tokenizer(text, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    print(f"tokenizer {len(tokenizer)} tokens, logits {vocab}; document {len(tokens)} tokens")
    results: dict[str, Any] = {
        "apply_ms": {rows: _apply_cost(vocab, rows) * 1e3 for rows in (1, 9)}
    }
    for rows, ms in results["apply_ms"].items():
        print(f"bitmask onto logits [{rows}, {vocab}]: {ms:.3f} ms")
    for name, build in BUILDERS.items():
        if importlib.util.find_spec(name) is None:
            continue
        engine = build(tokenizer, vocab)
        start = time.perf_counter()
        compiled = engine.compile(SCHEMA)
        compile_seconds = time.perf_counter() - start
        runs: dict[str, list[float]] = {"mask": [], "advance": []}
        allowed: list[float] = []
        for _ in range(args.rounds):
            walk = _walk(engine, compiled, tokens, words)
            runs["mask"] += walk["mask"]
            runs["advance"] += walk["advance"]
            allowed = walk["allowed"]
        rollback = _rolls_back(engine, compiled, tokens, words)
        results[name] = {
            "setup_s": engine.setup_seconds,
            "compile_s": compile_seconds,
            "mask_ms_median": statistics.median(runs["mask"]) * 1e3,
            "advance_ms_median": statistics.median(runs["advance"]) * 1e3,
            "rollback": rollback,
            # Tokens allowed at each position of the walk: the masks are not trivial.
            "allowed_per_position": allowed,
        }
        print(
            f"{name}: setup {engine.setup_seconds:.2f} s, compile {compile_seconds:.3f} s, "
            f"mask {_ms(runs['mask'])}, advance {_ms(runs['advance'])}, rollback {rollback}, "
            f"tokens allowed per position: median {statistics.median(allowed):.0f}, "
            f"min {min(allowed):.0f}, max {max(allowed):.0f}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
