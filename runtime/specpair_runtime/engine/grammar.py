"""Grammars for structured outputs: what a request constrains, compiled once, off the engine thread.

A ``GrammarSpec`` names what the output must match: a JSON schema, any JSON
object, a regular expression, one of a list of strings, or a Lark grammar
(tool calls are a Lark grammar with embedded JSON schemas; ``server/tools.py``
writes it). ``GrammarCompiler`` turns a spec into a ``CompiledGrammar`` with
llguidance (``docs/structured-outputs.md`` has the measurements that chose it):

- a spec that llguidance cannot compile raises ``GrammarError`` with
  llguidance's own message (the server answers 400 with it);
- compiled grammars are cached per spec (LRU), so a schema that every request
  of an application sends compiles once;
- ``compile_async`` compiles on a worker thread (llguidance releases the GIL
  while it builds the grammar), so a slow compile never stalls the engine
  thread nor the event loop; concurrent requests for one spec share one
  compile.

A ``CompiledGrammar`` holds a template matcher in its start state; each
request gets its own copy (``new_matcher``, a microsecond) to advance.

JSON is generated on one line with ``", "`` and ``": "`` between items (as
``json.dumps`` writes it and as Qwen's tool-call format shows it): with free
whitespace a model may emit newlines forever inside an object, and JSON's
meaning does not depend on it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import llguidance
import llguidance.hf

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "lark"]

JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
# Compiled grammars kept per compiler; a template matcher holds its lexer (kilobytes
# to a few megabytes for large schemas).
DEFAULT_CACHE_SIZE = 256
DEFAULT_COMPILE_THREADS = 2


class GrammarError(ValueError):
    """A spec the engine cannot compile; the message names the problem."""


@dataclass(frozen=True)
class GrammarSpec:
    """What an output must match.

    ``source``: the JSON schema (as canonical JSON text, key order kept: it is
    the order properties are generated in), the regex, the JSON list of
    choices, or the Lark grammar; empty for ``json_object``.
    """

    kind: GrammarKind
    source: str = ""

    @staticmethod
    def json_schema(schema: dict[str, Any]) -> GrammarSpec:
        return GrammarSpec("json_schema", json.dumps(schema, ensure_ascii=False))

    @staticmethod
    def json_object() -> GrammarSpec:
        return GrammarSpec("json_object")

    @staticmethod
    def regex(pattern: str) -> GrammarSpec:
        return GrammarSpec("regex", pattern)

    @staticmethod
    def choice(options: Iterable[str]) -> GrammarSpec:
        return GrammarSpec("choice", json.dumps(list(options), ensure_ascii=False))

    @staticmethod
    def lark(grammar: str) -> GrammarSpec:
        return GrammarSpec("lark", grammar)


def json_schema_for_lark(schema: dict[str, Any]) -> str:
    """``schema`` with the engine's JSON layout, for a ``%json`` block of a Lark grammar."""
    return json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def lark_literal(text: str) -> str:
    """A Lark string literal matching ``text`` exactly (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def grammar_text(spec: GrammarSpec) -> str:
    """llguidance's serialized grammar for ``spec`` (not yet checked)."""
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.source)
        except json.JSONDecodeError as error:
            raise GrammarError(f"the schema is not JSON: {error}") from None
        if not isinstance(schema, dict | bool):
            raise GrammarError("the schema must be a JSON object")
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        return _from_json_schema(schema)
    if spec.kind == "json_object":
        return _from_json_schema({"type": "object"})
    if spec.kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(spec.source))
    if spec.kind == "choice":
        options = json.loads(spec.source)
        if not options:
            raise GrammarError("the list of choices is empty")
        alternatives = " | ".join(lark_literal(option) for option in options)
        return str(llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n"))
    return str(llguidance.LLMatcher.grammar_from_lark(spec.source))


def _from_json_schema(schema: dict[str, Any]) -> str:
    try:
        return str(llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS))
    except ValueError as error:
        raise GrammarError(str(error)) from None


class CompiledGrammar:
    """A checked grammar and its template matcher in the start state.

    ``vocab_size`` and ``end_ids``: the compiler's (the logits' width, the
    tokens that end a generation).
    """

    def __init__(
        self,
        spec: GrammarSpec,
        template: llguidance.LLMatcher,
        vocab_size: int,
        end_ids: tuple[int, ...],
    ) -> None:
        self.spec = spec
        self.vocab_size = vocab_size
        self.end_ids = end_ids
        self._template = template

    def new_matcher(self) -> llguidance.LLMatcher:
        """A fresh matcher in the start state (a copy of the template)."""
        return self._template.deep_copy()


class GrammarCompiler:
    """Compiles specs for one tokenizer and vocabulary; thread-safe.

    ``vocab_size``: the width of the model's logits (at least the tokenizer's
    size: padding ids are never allowed). ``eos_ids``: the tokens that end a
    generation; a grammar allows them once it accepts.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_ids: Iterable[int],
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
        threads: int = DEFAULT_COMPILE_THREADS,
    ) -> None:
        eos = sorted(set(eos_ids))
        if not eos:
            raise ValueError("eos_ids: a grammar needs at least one end-of-generation token")
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        self.eos_ids = tuple(eos)
        self.cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._pending: dict[GrammarSpec, Future[CompiledGrammar]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self.compiles = 0  # grammars built (cache misses), for tests and metrics

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar, from the cache or built on this thread."""
        with self._lock:
            cached = self._cached(spec)
        if cached is not None:
            return cached
        return self._store(spec, self._build(spec))

    def compile_async(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """A future of the compiled grammar, built on a worker thread (or done if cached)."""
        with self._lock:
            cached = self._cached(spec)
            if cached is not None:
                done: Future[CompiledGrammar] = Future()
                done.set_result(cached)
                return done
            pending = self._pending.get(spec)
            if pending is None or pending.cancelled():
                pending = self._pool.submit(self._compile_pending, spec)
                self._pending[spec] = pending
            return pending

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _cached(self, spec: GrammarSpec) -> CompiledGrammar | None:
        compiled = self._cache.get(spec)
        if compiled is not None:
            self._cache.move_to_end(spec)
        return compiled

    def _compile_pending(self, spec: GrammarSpec) -> CompiledGrammar:
        try:
            return self._store(spec, self._build(spec))
        finally:
            with self._lock:
                self._pending.pop(spec, None)

    def _store(self, spec: GrammarSpec, compiled: CompiledGrammar) -> CompiledGrammar:
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _build(self, spec: GrammarSpec) -> CompiledGrammar:
        grammar = grammar_text(spec)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise GrammarError(error)
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(template.get_error())
        with self._lock:
            self.compiles += 1
        return CompiledGrammar(spec, template, self.vocab_size, self.eos_ids)
