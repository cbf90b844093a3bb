"""Each token's real bytes, and the name OpenAI's ``logprobs`` show for it.

A token of a byte-level vocabulary (GPT-2, Qwen, Llama 3) or a byte-fallback
one (``<0xE4>`` in SentencePiece vocabularies: Llama 2, Mistral) may hold part
of a multi-byte character. Decoded on its own it reads as U+FFFD, so its
bytes are read from the vocabulary instead: a client rebuilds the character
from the ``bytes`` of consecutive tokens. Such a token is named
``bytes:\\xe4\\xb8`` (its bytes escaped), as OpenAI names them; a token of
whole characters is named by its text.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# SentencePiece's word-boundary mark, which stands for a space.
SPACE_MARK = "\u2581"
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")

ByteReader = Callable[[int], bytes]


@dataclass(frozen=True)
class TokenPiece:
    text: str  # the token's text, or "bytes:\\x.." when its bytes are no whole characters
    data: bytes  # the bytes the token adds to the output


TokenPieces = Callable[[int], TokenPiece]


def gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are mapped,
    in order, to the characters from U+0100 on (the table every byte-level BPE uses).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    alphabet = {chr(byte): byte for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in printable:
            alphabet[chr(256 + shifted)] = byte
            shifted += 1
    return alphabet


def decoder_kind(tokenizer: Any) -> str:
    """How the vocabulary spells bytes: "byte_level", "byte_fallback" or "text"."""
    if getattr(tokenizer, "byte_decoder", None):  # a slow GPT-2-style tokenizer
        return "byte_level"
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return "text"
    state = json.loads(decoder.__getstate__())
    parts = [state, *state.get("decoders", [])]
    types = {part.get("type") for part in parts}
    if "ByteLevel" in types:
        return "byte_level"
    if "ByteFallback" in types or "Metaspace" in types:
        return "byte_fallback"
    return "text"


def byte_reader(tokenizer: Any) -> ByteReader:
    """A function from token id to the token's bytes, for this tokenizer's vocabulary."""
    added = {
        token_id: str(token.content)
        for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
    }
    kind = decoder_kind(tokenizer)
    alphabet = gpt2_byte_alphabet()

    def spelled(token_id: int) -> str | None:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        return piece if isinstance(piece, str) else None  # None: beyond the vocabulary

    def read(token_id: int) -> bytes:
        if token_id in added:  # special and added tokens are plain text
            return added[token_id].encode("utf-8")
        if kind == "text":
            decoded: str = tokenizer.decode([token_id], skip_special_tokens=False)
            return decoded.encode("utf-8")
        piece = spelled(token_id)
        if piece is None:
            return b""
        if kind == "byte_level":
            if all(char in alphabet for char in piece):
                return bytes(alphabet[char] for char in piece)
            return piece.encode("utf-8")
        match = BYTE_FALLBACK.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace(SPACE_MARK, " ").encode("utf-8")

    return read


def piece_of(data: bytes) -> TokenPiece:
    try:
        return TokenPiece(data.decode("utf-8"), data)
    except UnicodeDecodeError:
        return TokenPiece("bytes:" + "".join(f"\\x{byte:02x}" for byte in data), data)


def token_pieces(tokenizer: Any, cache_size: int = 65536) -> TokenPieces:
    """Each token id's piece, cached: the same tokens recur in every answer."""
    read = byte_reader(tokenizer)

    @functools.lru_cache(maxsize=cache_size)
    def piece(token_id: int) -> TokenPiece:
        return piece_of(read(token_id))

    return piece
