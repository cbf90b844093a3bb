"""The end-of-generation tokens of a model read from a GGUF file.

A GGUF file names one EOS id (``tokenizer.ggml.eos_token_id``), while a
model's own generation config may name several. Qwen2.5's names
``<|im_end|>`` and ``<|endoftext|>``, and its GGUF files only the first, so
a raw completion from the demo pair ran on past ``<|endoftext|>`` into a new
document. llama.cpp closes this gap by token text (``llama-vocab.cpp``: its
end-of-turn texts), and so does this module, with the same texts.
"""

from __future__ import annotations

from typing import Any

# llama.cpp's end-of-turn token texts, matched only among special tokens.
END_OF_GENERATION_TEXTS = (
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<EOT>",
    "_<EOT>",
    "<｜end▁of▁sentence｜>",
)


def end_of_generation_ids(tokenizer: Any) -> list[int]:
    """Sorted ids of the tokenizer's special tokens whose text ends a generation."""
    decoder: dict[int, Any] = getattr(tokenizer, "added_tokens_decoder", {})
    return sorted(
        token_id
        for token_id, token in decoder.items()
        if getattr(token, "special", False)
        and getattr(token, "content", None) in END_OF_GENERATION_TEXTS
    )


def add_end_of_generation(model: Any, tokenizer: Any) -> list[int]:
    """Add those ids to ``model.generation_config.eos_token_id``; return the ids in force.

    The ids already named come first, in their order (the first is the one
    that transformers pads with when no pad token is set).
    """
    config = model.generation_config
    named = config.eos_token_id
    ids = [named] if isinstance(named, int) else list(named or [])
    ids += [i for i in end_of_generation_ids(tokenizer) if i not in ids]
    if ids:
        config.eos_token_id = ids[0] if len(ids) == 1 else ids
    return ids
