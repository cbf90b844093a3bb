"""OpenAI's ``logprobs`` shapes, built from the engine's ``TokenLogprob`` entries.

Each token is shown as its own decoded text (``tokenizer.decode([id])``), as
vLLM does: a token that holds part of a multi-byte character reads as U+FFFD,
and ``bytes`` then holds that replacement character's UTF-8. A log-probability
of minus infinity (a token that the model rules out) is sent as -9999.0, as
OpenAI and vLLM do, since JSON has no infinity.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

from specpair_runtime.engine.api import TokenLogprob
from specpair_runtime.server.schemas import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)

# What JSON gets for a log-probability of minus infinity.
LOGPROB_FLOOR = -9999.0

TokenText = Callable[[int], str]


def token_texts(tokenizer: Any, cache_size: int = 65536) -> TokenText:
    """Each token id's own text, cached: the same tokens recur in every answer."""

    @functools.lru_cache(maxsize=cache_size)
    def text(token_id: int) -> str:
        decoded: str = tokenizer.decode([token_id], skip_special_tokens=False)
        return decoded

    return text


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def _top(token_id: int, logprob: float, text: TokenText) -> TopLogprob:
    token = text(token_id)
    return TopLogprob(token=token, logprob=finite(logprob), bytes=list(token.encode("utf-8")))


def chat_logprobs(entries: Sequence[TokenLogprob], text: TokenText) -> ChatLogprobs:
    """``choices[].logprobs`` of a chat answer or chunk."""
    content = []
    for entry in entries:
        chosen = _top(entry.token_id, entry.logprob, text)
        content.append(
            ChatTokenLogprob(
                token=chosen.token,
                logprob=chosen.logprob,
                bytes=chosen.bytes,
                top_logprobs=[_top(t, lp, text) for t, lp in entry.top],
            )
        )
    return ChatLogprobs(content=content)


class CompletionLogprobsBuilder:
    """``choices[].logprobs`` of a completion; keeps the text offset across stream chunks."""

    def __init__(self, text: TokenText) -> None:
        self.text = text
        self.offset = 0

    def build(self, entries: Sequence[TokenLogprob]) -> CompletionLogprobs:
        tokens, offsets, tops = [], [], []
        for entry in entries:
            token = self.text(entry.token_id)
            tokens.append(token)
            offsets.append(self.offset)
            self.offset += len(token)
            # The chosen token first, then the alternatives (a text shared by two ids
            # keeps the first one's value: the legacy shape is keyed by text).
            top = {token: finite(entry.logprob)}
            for token_id, logprob in entry.top:
                top.setdefault(self.text(token_id), finite(logprob))
            tops.append(top)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[finite(e.logprob) for e in entries],
            top_logprobs=tops,
            text_offset=offsets,
        )
