"""Incremental detokenization and stopping (EOS, stop strings, max tokens).

Only verified tokens reach this module. Text is released as soon as it is
final: the detokenizer holds back an incomplete UTF-8 sequence (a trailing
U+FFFD, at most 3 tokens) and releases the text before it, so bytes that
never form a character (a model's invalid UTF-8) do not stall the stream.
The stop checker holds back the longest tail of the text that could still
grow into a stop string. A found stop string is trimmed, with everything
after it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

# Prompt tokens decoded as context, so that the first output token's leading
# space (SentencePiece) or merged bytes come out right.
CONTEXT_TOKENS = 5
# A UTF-8 character is at most 4 bytes and a token adds at least one, so an
# incomplete character at the end of the text starts in one of the last 3 tokens.
MAX_INCOMPLETE_TOKENS = 3

StopReason = Literal["stop", "length"]


class IncrementalDetokenizer:
    """vLLM-style incremental decoding with a prefix offset and a read offset."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: Sequence[int]) -> str:
        text: str = self.tokenizer.decode(list(ids), skip_special_tokens=True)
        return text

    def add(self, token_id: int) -> str:
        """Append a token; return the text that became final (may be empty)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if not new_text.endswith("\ufffd"):
            if len(new_text) > len(prefix_text):
                return self._release(len(self.ids), new_text, prefix_text)
            return ""
        # The text ends in an incomplete character that the next tokens may
        # complete, but what comes before it may be final (bytes that no token
        # completes, from a model that emits invalid UTF-8). A split of the last
        # tokens whose two sides decode as the whole is a boundary that later
        # bytes cannot move: release the text before the latest such split.
        last = len(self.ids) - 1
        for split in range(last, max(self.read_offset, last - MAX_INCOMPLETE_TOKENS), -1):
            head = self._decode(self.ids[self.prefix_offset : split])
            if len(head) <= len(prefix_text):
                break  # nothing new before this split, nor before any earlier one
            # The tail must hold bytes (not only skipped special tokens): the
            # first of them is what decides the head's last character.
            tail = self._decode(self.ids[split:])
            if tail and head + tail == new_text:
                return self._release(split, head, prefix_text)
        return ""

    def _release(self, end: int, text: str, prefix_text: str) -> str:
        """Text of the tokens up to ``end`` is final: return its new part."""
        self.prefix_offset = self.read_offset
        self.read_offset = end
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is still held (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


def held_suffix_length(text: str, stops: Iterable[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:size]):
                best = size
                break
    return best


def find_stop(text: str, stops: Iterable[str]) -> int | None:
    """Index of the earliest stop-string occurrence in ``text``, or None."""
    found = [index for stop in stops if stop and (index := text.find(stop)) >= 0]
    return min(found) if found else None


@dataclass(frozen=True)
class PushResult:
    token_ids: list[int]  # the committed tokens kept (cut after a stop)
    text: str  # text released now
    finish_reason: StopReason | None


class OutputStream:
    """One request's output: tokens in, releasable text and a stop decision out."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        *,
        eos_ids: Iterable[int],
        stop: Sequence[str],
        max_new_tokens: int,
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.eos_ids = frozenset(eos_ids)
        self.stop = tuple(s for s in stop if s)
        self.max_new_tokens = max_new_tokens
        self.generated = 0
        self.pending = ""  # decoded, not yet released
        self.finish_reason: StopReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, tokens: Sequence[int]) -> PushResult:
        """Add committed tokens in order; stops at the first stop condition."""
        if self.finished:
            return PushResult([], "", self.finish_reason)
        kept: list[int] = []
        for token in tokens:
            kept.append(token)
            self.generated += 1
            if token in self.eos_ids:
                self.finish_reason = "stop"
                break
            self.pending += self.detokenizer.add(token)
            if self.stop:
                index = find_stop(self.pending, self.stop)
                if index is not None:
                    text, self.pending = self.pending[:index], ""
                    self.finish_reason = "stop"
                    return PushResult(kept, text, "stop")
            if self.generated >= self.max_new_tokens:
                self.finish_reason = "length"
                break
        if self.finished:
            text = self.pending + self.detokenizer.flush()
            self.pending = ""
            if self.stop:  # the flushed tail may complete a stop string
                index = find_stop(text, self.stop)
                text = text if index is None else text[:index]
            return PushResult(kept, text, self.finish_reason)
        held = held_suffix_length(self.pending, self.stop)
        cut = len(self.pending) - held
        text, self.pending = self.pending[:cut], self.pending[cut:]
        return PushResult(kept, text, None)

    def finish_abort(self) -> str:
        """Text still held when a request ends for another reason (not released)."""
        rest = self.pending + self.detokenizer.flush()
        self.pending = ""
        return rest
