"""Turn prompt text into token ids, plainly or through the chat template."""

from __future__ import annotations

from typing import Any


class PromptError(ValueError):
    """A prompt that cannot be encoded (e.g. --chat without a chat template)."""


def encode_prompt(tokenizer: Any, text: str, *, chat: bool = False) -> list[int]:
    """Token ids of ``text``; with ``chat``, as one user message plus the generation prompt."""
    if not chat:
        ids = list(tokenizer(text).input_ids)
    else:
        if not getattr(tokenizer, "chat_template", None):
            raise PromptError(
                "the target tokenizer has no chat template, so a chat prompt cannot be encoded"
            )
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        # The template writes its own special tokens (BOS etc.); don't add them twice.
        ids = list(tokenizer(rendered, add_special_tokens=False).input_ids)
    if not ids:
        raise PromptError("the prompt encodes to zero tokens")
    return [int(i) for i in ids]
