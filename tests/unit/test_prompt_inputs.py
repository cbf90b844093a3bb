"""Completion prompts as strings, lists and token ids; choice indices and seeds for n."""

from __future__ import annotations

import pytest
from tools.tiny_models import build_tokenizer

from specpair_runtime.server.prompt_inputs import (
    MAX_PROMPTS,
    PromptInput,
    PromptShapeError,
    choice_index,
    echo_text,
    prompt_inputs,
    sample_seed,
)

VOCAB = 100


def test_every_prompt_shape() -> None:
    assert prompt_inputs("hi", VOCAB) == [PromptInput("prompt", text="hi")]
    assert prompt_inputs(["a", "b"], VOCAB) == [
        PromptInput("prompt[0]", text="a"),
        PromptInput("prompt[1]", text="b"),
    ]
    assert prompt_inputs([5, 6, 7], VOCAB) == [PromptInput("prompt", token_ids=(5, 6, 7))]
    assert prompt_inputs([[1], [2, 3]], VOCAB) == [
        PromptInput("prompt[0]", token_ids=(1,)),
        PromptInput("prompt[1]", token_ids=(2, 3)),
    ]


@pytest.mark.parametrize(
    ("prompt", "field", "message"),
    [
        ([], "prompt", "empty list"),
        ([[1, 2], []], "prompt[1]", "no token ids"),
        ([1, VOCAB], "prompt[1]", f"token id {VOCAB} is outside"),
        ([[0], [3, -1]], "prompt[1][1]", "token id -1 is outside"),
        (["x"] * (MAX_PROMPTS + 1), "prompt", f"at most {MAX_PROMPTS}"),
    ],
)
def test_bad_prompts_name_the_place(prompt: list, field: str, message: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(PromptShapeError, match=message) as error:
        prompt_inputs(prompt, VOCAB)
    assert error.value.field == field


def test_choices_are_numbered_prompt_by_prompt() -> None:
    indices = [choice_index(p, i, 3) for p in range(2) for i in range(3)]
    assert indices == [0, 1, 2, 3, 4, 5]


def test_each_choice_has_its_own_seed() -> None:
    assert [sample_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert sample_seed(None, 2) is None
    assert sample_seed(2**63 - 1, 1) == 0


def test_echo_gives_the_prompt_text() -> None:
    tokenizer = build_tokenizer()
    ids = tokenizer("Hello, how can I help", add_special_tokens=False).input_ids
    assert echo_text(tokenizer, PromptInput("prompt", token_ids=tuple(ids))) == (
        "Hello, how can I help"
    )
    assert echo_text(tokenizer, PromptInput("prompt", text="as given ")) == "as given "
