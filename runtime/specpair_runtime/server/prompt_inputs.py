"""The shapes of ``/v1/completions`` prompts, ``n`` choices and ``echo``.

OpenAI's ``prompt`` is a string, a list of strings, a list of token ids, or a
list of lists of token ids; each prompt gives ``n`` choices. Choice ``i`` of
prompt ``p`` has index ``p * n + i`` (OpenAI's and vLLM's order), and every
choice is its own engine request: the ``n`` requests of one prompt share
the prompt's KV through prefix reuse (``engine/prefix_reuse.py``), so the
prompt is read once. With a ``seed``, choice ``i`` samples with ``seed + i``:
the choices differ, and the same request gives the same choices.

``echo`` puts the prompt's text before each choice's text (for token-id
prompts, the decoded ids).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Prompts per request; each becomes n engine requests.
MAX_PROMPTS = 64
# Choices per prompt (vLLM has no limit; this keeps one request within a batch's reach).
MAX_CHOICES = 16
MAX_SEED = 2**63


class PromptShapeError(ValueError):
    """A prompt list the server cannot take; ``field`` names the place."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class PromptInput:
    """One prompt: its text (None for token ids) or its token ids (None for text)."""

    field: str  # where errors point: "prompt" or "prompt[2]"
    text: str | None = None
    token_ids: tuple[int, ...] | None = None


PromptField = str | list[str] | list[int] | list[list[int]]


def _ids(values: Sequence[int], field: str, vocab_size: int) -> tuple[int, ...]:
    if not values:
        raise PromptShapeError(field, "holds no token ids")
    for index, token in enumerate(values):
        if not 0 <= token < vocab_size:
            raise PromptShapeError(
                f"{field}[{index}]", f"token id {token} is outside the vocabulary [0, {vocab_size})"
            )
    return tuple(values)


def prompt_inputs(prompt: PromptField, vocab_size: int) -> list[PromptInput]:
    """The request's prompts, in order; PromptShapeError names a bad one."""
    if isinstance(prompt, str):
        return [PromptInput("prompt", text=prompt)]
    if not prompt:
        raise PromptShapeError("prompt", "is an empty list")
    if len(prompt) > MAX_PROMPTS:
        raise PromptShapeError("prompt", f"at most {MAX_PROMPTS} prompts, got {len(prompt)}")
    first = prompt[0]
    if isinstance(first, int):  # one prompt of token ids
        return [PromptInput("prompt", token_ids=_ids(prompt, "prompt", vocab_size))]  # type: ignore[arg-type]
    inputs = []
    for index, item in enumerate(prompt):
        field = f"prompt[{index}]"
        if isinstance(item, str):
            inputs.append(PromptInput(field, text=item))
        else:
            inputs.append(PromptInput(field, token_ids=_ids(item, field, vocab_size)))  # type: ignore[arg-type]
    return inputs


def choice_index(prompt_index: int, sample: int, n: int) -> int:
    """The index of choice ``sample`` of prompt ``prompt_index`` among all choices."""
    return prompt_index * n + sample


def sample_seed(seed: int | None, sample: int) -> int | None:
    """The seed of choice ``sample``: ``seed + sample`` (wrapping below 2**63), or None."""
    return None if seed is None else (seed + sample) % MAX_SEED


def echo_text(tokenizer: object, prompt: PromptInput) -> str:
    """The text ``echo`` puts before the completion."""
    if prompt.text is not None:
        return prompt.text
    assert prompt.token_ids is not None
    decoded: str = tokenizer.decode(list(prompt.token_ids))  # type: ignore[attr-defined]
    return decoded
