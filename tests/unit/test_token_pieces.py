"""Token bytes and names (``server/token_pieces.py``) on real tokenizers built in code."""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models
from tools.tiny_models import build_tokenizer
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from specpair_runtime.server.token_pieces import (
    decoder_kind,
    gpt2_byte_alphabet,
    token_pieces,
)

TEXT = "héllo 世界 😀 def add(a, b):"


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style vocabulary (Llama 2, Mistral): words, ▁ for spaces, <0xNN> bytes."""
    vocab = {"<unk>": 0, "</s>": 1, "▁h": 2, "é": 3, "llo": 4, "A": 5, "▁": 6}
    vocab.update({f"<0x{byte:02X}>": 7 + byte for byte in range(256)})
    model = models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True)
    tokenizer = Tokenizer(model)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="</s>")  # type: ignore[no-untyped-call]


def test_the_gpt2_alphabet_is_transformers_own() -> None:
    table = bytes_to_unicode()  # type: ignore[no-untyped-call]
    assert gpt2_byte_alphabet() == {char: byte for byte, char in table.items()}


def test_byte_level_tokens_rebuild_the_text_from_their_bytes() -> None:
    tokenizer = build_tokenizer()
    assert decoder_kind(tokenizer) == "byte_level"
    pieces = token_pieces(tokenizer)
    ids = tokenizer.encode(TEXT)
    parts = [pieces(i) for i in ids]
    assert b"".join(p.data for p in parts).decode() == TEXT
    split = [p for p in parts if p.text.startswith("bytes:")]
    assert split, "the tiny vocabulary splits CJK characters and emoji into byte tokens"
    for part in split:
        assert part.text == "bytes:" + "".join(f"\\x{b:02x}" for b in part.data)
    whole = [p for p in parts if not p.text.startswith("bytes:")]
    assert all(p.text == p.data.decode() for p in whole)


def test_every_byte_token_of_a_byte_level_vocabulary_has_its_own_name() -> None:
    tokenizer = build_tokenizer()
    pieces = token_pieces(tokenizer)
    names = [pieces(i).text for i in range(len(tokenizer))]
    assert len(set(names)) == len(names)


def test_special_tokens_and_ids_beyond_the_vocabulary() -> None:
    tokenizer = build_tokenizer()
    pieces = token_pieces(tokenizer)
    eos = pieces(tokenizer.eos_token_id)
    assert (eos.text, eos.data) == (tokenizer.eos_token, tokenizer.eos_token.encode())
    assert pieces(len(tokenizer) + 3).data == b""  # a padded embedding row: no text


def test_byte_fallback_vocabularies_give_real_bytes_and_spaces() -> None:
    tokenizer = byte_fallback_tokenizer()
    assert decoder_kind(tokenizer) == "byte_fallback"
    pieces = token_pieces(tokenizer)
    assert (pieces(2).text, pieces(2).data) == (" h", b" h")
    assert (pieces(7 + 0xE4).text, pieces(7 + 0xE4).data) == ("bytes:\\xe4", b"\xe4")
    assert pieces(7 + 0x41).text == pieces(5).text == "A"  # the collision logprobs.py keys apart
    ids = tokenizer.encode("hé世")
    assert b"".join(pieces(i).data for i in ids).decode().strip() == "hé世"


def test_a_tokenizer_without_a_vocabulary_decoder_decodes_each_token() -> None:
    class Plain:
        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            return {1: "ab", 2: "\ufffd"}[ids[0]]

        def convert_ids_to_tokens(self, token_id: int) -> Any:
            raise AssertionError("not read for a plain tokenizer")

    pieces = token_pieces(Plain())
    assert pieces(1).text == "ab"
    assert pieces(2).data == "\ufffd".encode()


@pytest.mark.parametrize("token_id", [0, 1, 2])
def test_pieces_are_cached(token_id: int) -> None:
    calls: list[int] = []

    class Counting:
        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            calls.append(ids[0])
            return "x"

    pieces = token_pieces(Counting())
    assert pieces(token_id) == pieces(token_id)
    assert calls == [token_id]
