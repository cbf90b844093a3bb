"""The alignment check: each kind of difference is detected and named."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specpair_runtime.engine.alignment import check_alignment

WORDS = ["hello", "world", "the", "cat", "sat", "on", "mat", "dog"]
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"


def make_tokenizer(
    words: list[str] = WORDS,
    specials: tuple[str, str, str] = ("<s>", "</s>", "<pad>"),
    template: str | None = TEMPLATE,
) -> Any:
    """A word-level tokenizer: ids 0-3 are bos/eos/pad/unk, then ``words`` in order."""
    bos, eos, pad = specials
    vocab = {bos: 0, eos: 1, pad: 2, "<unk>": 3}
    vocab.update({word: index + 4 for index, word in enumerate(words)})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core, bos_token=bos, eos_token=eos, pad_token=pad, unk_token="<unk>"
    )
    tokenizer.chat_template = template
    return tokenizer


def make_model(vocab_size: int) -> Any:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def test_identical_tokenizers_are_aligned() -> None:
    report = check_alignment(make_tokenizer(), make_tokenizer())
    assert report.aligned
    assert report.problems == []
    assert report.refusal_reason is None
    assert report.shared_vocab_size == len(WORDS) + 4


def test_different_vocab_is_named() -> None:
    swapped = ["hello", "world", "the", "sat", "cat", "on", "mat", "dog"]
    report = check_alignment(make_tokenizer(), make_tokenizer(words=swapped))
    assert not report.aligned
    assert len(report.problems) == 1
    problem = report.problems[0]
    assert problem.startswith("vocab: 2 tokens map to different ids")
    assert "id 7 is 'cat' in the target and 'sat' in the draft" in problem
    reason = report.refusal_reason
    assert reason is not None and "vocab: 2 tokens" in reason


@pytest.mark.parametrize(
    ("specials", "kind", "expected"),
    [
        (("<s>", "<|end|>", "<pad>"), "eos", "target '</s>' (1) != draft '<|end|>' (1)"),
        (("<bos>", "</s>", "<pad>"), "bos", "target '<s>' (0) != draft '<bos>' (0)"),
        (("<s>", "</s>", "[PAD]"), "pad", "target '<pad>' (2) != draft '[PAD]' (2)"),
    ],
)
def test_different_special_token_is_named(
    specials: tuple[str, str, str], kind: str, expected: str
) -> None:
    report = check_alignment(make_tokenizer(), make_tokenizer(specials=specials))
    assert not report.aligned
    assert f"special token {kind}: {expected}" in report.problems
    # The renamed special token also changes the token at its id.
    assert any(p.startswith("vocab: 1 token maps") for p in report.problems)


def test_special_token_with_same_vocab_but_other_role_is_named() -> None:
    # Same token->id map, but the draft calls "<pad>" its EOS: only the role differs.
    draft = make_tokenizer()
    draft.eos_token = "<pad>"
    report = check_alignment(make_tokenizer(), draft)
    assert report.problems == ["special token eos: target '</s>' (1) != draft '<pad>' (2)"]


def test_missing_special_token_is_named() -> None:
    draft = make_tokenizer()
    draft.pad_token = None
    report = check_alignment(make_tokenizer(), draft)
    assert report.problems == ["special token pad: target '<pad>' (2) != draft unset"]


def test_different_chat_template_is_named() -> None:
    other = TEMPLATE.replace("\n", " ")
    report = check_alignment(make_tokenizer(), make_tokenizer(template=other))
    assert report.problems == [
        f"chat template differs (first difference at character {TEMPLATE.index(chr(10))})"
    ]


def test_missing_chat_template_is_named() -> None:
    report = check_alignment(make_tokenizer(), make_tokenizer(template=None))
    assert report.problems == ["chat template differs: the draft has none"]


def test_extra_tokens_past_the_shared_range_are_a_note_not_a_problem() -> None:
    report = check_alignment(make_tokenizer(), make_tokenizer(words=[*WORDS, "extra"]))
    assert report.aligned
    assert report.shared_vocab_size == len(WORDS) + 4
    assert report.draft_vocab_size == len(WORDS) + 5
    assert "vocab sizes differ" in report.notes[0]


def test_vocab_padding_is_not_a_mismatch() -> None:
    tokenizer = make_tokenizer()
    target = make_model(len(tokenizer))
    draft = make_model(len(tokenizer))
    draft.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)
    assert draft.get_input_embeddings().num_embeddings == 64
    report = check_alignment(tokenizer, make_tokenizer(), target_model=target, draft_model=draft)
    assert report.aligned, report.problems
    assert report.notes == []


def test_model_narrower_than_its_tokenizer_is_a_note() -> None:
    tokenizer = make_tokenizer()
    report = check_alignment(
        tokenizer, make_tokenizer(), target_model=make_model(len(tokenizer) - 2)
    )
    assert report.aligned
    assert report.notes == [
        f"target model scores {len(tokenizer) - 2} ids but its tokenizer has {len(tokenizer)}"
    ]
