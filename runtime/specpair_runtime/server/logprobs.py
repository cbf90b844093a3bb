"""OpenAI's ``logprobs`` shapes, built from the engine's ``TokenLogprob`` entries.

Each token is named and carries its bytes as ``token_pieces.py`` reads them:
a token that holds part of a multi-byte character is ``bytes:\\xe4`` with
its real bytes, so a client can rebuild the character. The completions
shape maps token name to log-probability; two different tokens that share a
name (say ``A`` and the byte-fallback ``<0x41>``, or ids beyond the
tokenizer's vocabulary) would collide there, so every one after the first is
keyed ``token_id:ID`` (vLLM's spelling of a token as its id) and no
alternative is lost. A log-probability of minus infinity (a token the model
rules out) is sent as -9999.0, as OpenAI and vLLM do, since JSON has no
infinity.
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Sequence

from specpair_runtime.engine.api import TokenLogprob
from specpair_runtime.server.schemas import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)
from specpair_runtime.server.token_pieces import TokenPieces

# What JSON gets for a log-probability of minus infinity.
LOGPROB_FLOOR = -9999.0


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def _top(token_id: int, logprob: float, pieces: TokenPieces) -> TopLogprob:
    piece = pieces(token_id)
    return TopLogprob(token=piece.text, logprob=finite(logprob), bytes=list(piece.data))


def chat_logprobs(entries: Sequence[TokenLogprob], pieces: TokenPieces) -> ChatLogprobs:
    """``choices[].logprobs`` of a chat answer or chunk."""
    content = []
    for entry in entries:
        chosen = _top(entry.token_id, entry.logprob, pieces)
        content.append(
            ChatTokenLogprob(
                token=chosen.token,
                logprob=chosen.logprob,
                bytes=chosen.bytes,
                top_logprobs=[_top(t, lp, pieces) for t, lp in entry.top],
            )
        )
    return ChatLogprobs(content=content)


def keyed_alternatives(entry: TokenLogprob, pieces: TokenPieces) -> dict[str, float]:
    """The chosen token, then the alternatives, by name; a taken name falls back to the id."""
    top: dict[str, float] = {}
    owners: dict[str, int] = {}
    for token_id, logprob in ((entry.token_id, entry.logprob), *entry.top):
        key = pieces(token_id).text
        if owners.get(key, token_id) != token_id:
            key = f"token_id:{token_id}"
        if key not in top:  # the chosen token is usually among the alternatives too
            top[key] = finite(logprob)
            owners[key] = token_id
    return top


class CompletionLogprobsBuilder:
    """``choices[].logprobs`` of a completion; keeps the text offset across stream chunks.

    ``text_offset`` counts the characters of the text before each token: the
    tokens' bytes are decoded as a stream, so a token that ends a character
    split over several tokens points at that character's start.
    """

    def __init__(self, pieces: TokenPieces) -> None:
        self.pieces = pieces
        self.offset = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def build(self, entries: Sequence[TokenLogprob]) -> CompletionLogprobs:
        tokens, offsets, tops = [], [], []
        for entry in entries:
            piece = self.pieces(entry.token_id)
            tokens.append(piece.text)
            offsets.append(self.offset)
            self.offset += len(self._decoder.decode(piece.data))
            tops.append(keyed_alternatives(entry, self.pieces))
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[finite(e.logprob) for e in entries],
            top_logprobs=tops,
            text_offset=offsets,
        )
