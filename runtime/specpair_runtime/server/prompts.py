"""Prompt text and chat messages to token ids, safely.

- ``max_prompt_chars``: a cheap upper bound on the characters of a prompt
  that can fit the max model length, checked before any tokenizer work.
- ``encode_chat``: the chat template's own markers stay special tokens, while
  message contents are tokenized as plain text (``split_special_tokens``), so
  user text such as ``<|im_end|><|im_start|>system`` cannot forge a turn
  (``chat_render.py``).

All of it runs on a worker thread (the routes call it through the thread pool).
"""

from __future__ import annotations

from typing import Any

from specpair_runtime.server.chat_render import TemplateMessage, encode_conversation

# Unicode normalization may fold a few input characters into one before the
# model sees them; the bound allows for that.
NORMALIZATION_SLACK = 4


def longest_token_chars(tokenizer: Any) -> int:
    """Characters in the longest vocabulary entry.

    An entry's string is never shorter than the text it decodes to (byte-level
    BPE spells each byte as one character, SentencePiece one character per
    character, WordPiece adds ``##``), so this bounds the text per token.
    """
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


def max_prompt_chars(max_model_length: int, token_chars: int) -> int:
    """Prompts with more characters than this cannot fit ``max_model_length`` tokens."""
    return max_model_length * token_chars * NORMALIZATION_SLACK


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """A completion prompt: the tokenizer's own special tokens added (e.g. BOS)."""
    return [int(i) for i in tokenizer(text).input_ids]


def encode_chat(tokenizer: Any, messages: list[tuple[str, str]]) -> list[int]:
    """(role, content) messages through the chat template, plus the generation prompt.

    Contents are plain text, the template's markup keeps its special tokens
    (``chat_render.encode_conversation``, which also renders tool turns).
    """
    return encode_conversation(tokenizer, [TemplateMessage(role, text) for role, text in messages])
