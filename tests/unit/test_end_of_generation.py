"""Which tokens end a generation of a model read from GGUF (``end_of_generation.py``)."""

from __future__ import annotations

from types import SimpleNamespace

from tools.tiny_models import build_tokenizer

from specpair_runtime.engine.end_of_generation import (
    add_end_of_generation,
    end_of_generation_ids,
)


def test_only_special_tokens_with_an_end_of_turn_text_end_a_generation() -> None:
    tokenizer = build_tokenizer(bos="<|endoftext|>", eos="<|im_end|>")
    tokenizer.add_tokens(["<end_of_turn>"])  # an ordinary added token: text, not an end
    expected = [
        tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>", "<|end|>")
    ]
    assert end_of_generation_ids(tokenizer) == sorted(expected)


def test_the_named_eos_stays_first_and_nothing_is_named_twice() -> None:
    tokenizer = build_tokenizer(bos="<|endoftext|>", eos="<|im_end|>")
    im_end, endoftext, end = (
        tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>", "<|end|>")
    )
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=im_end))
    assert add_end_of_generation(model, tokenizer) == [im_end, *sorted([endoftext, end])]
    assert model.generation_config.eos_token_id == [im_end, *sorted([endoftext, end])]
    assert add_end_of_generation(model, tokenizer) == [im_end, *sorted([endoftext, end])]


def test_a_named_list_keeps_its_order_and_gains_only_what_it_lacks() -> None:
    tokenizer = build_tokenizer()  # </s> ends it; of the end-of-turn texts only <|end|>
    eos, end = (tokenizer.convert_tokens_to_ids(t) for t in ("</s>", "<|end|>"))
    assert end_of_generation_ids(tokenizer) == [end]
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[end, eos]))
    assert add_end_of_generation(model, tokenizer) == [end, eos]
    unnamed = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None))
    assert add_end_of_generation(unnamed, tokenizer) == [end]
    assert unnamed.generation_config.eos_token_id == end
