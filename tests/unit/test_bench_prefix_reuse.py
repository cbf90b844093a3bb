"""The prefix-reuse benchmark's helpers (the timed run needs the real pair)."""

from __future__ import annotations

from bench.bench_prefix_reuse import ratio_cell, system_prompt
from tools.tiny_models import build_tokenizer

from specpair_runtime.server.prompts import encode_chat


def test_the_system_prompt_has_the_words_asked_for() -> None:
    assert len(system_prompt(7).split()) == 7
    assert len(system_prompt(300).split()) == 300


def test_ratios_read_median_and_spread() -> None:
    assert ratio_cell([2.0, 1.0, 4.0]) == "2.00x [1.00-4.00]"


def test_questions_under_one_system_prompt_share_its_tokens() -> None:
    tokenizer = build_tokenizer()
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = (
            "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
        )
    system = system_prompt(40)
    first = encode_chat(tokenizer, [("system", system), ("user", "How long does a refund take?")])
    second = encode_chat(tokenizer, [("system", system), ("user", "Can I change my address?")])
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert shared >= len(tokenizer(system, add_special_tokens=False).input_ids) - 1
