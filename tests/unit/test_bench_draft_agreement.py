"""bench/bench_draft_agreement.py: the draft's top-1 agreement with the target's greedy tokens."""

from __future__ import annotations

import argparse

import pytest
import torch
from bench.bench_draft_agreement import (
    agreement,
    agreement_in_one_forward,
    agreement_table,
    format_table,
    main,
    parse_quantizations,
    target_greedy,
)
from tools.tiny_models import build_pair

from specpair_runtime.engine.prompting import encode_prompt


def test_quantizations_keep_the_runtime_order() -> None:
    assert parse_quantizations("int4-weight, none") == ["none", "int4-weight"]


@pytest.mark.parametrize("text", ["int3", "", "none,fp8"])
def test_bad_quantizations_name_the_flag(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_quantizations(text)
    with pytest.raises(SystemExit):
        main(["--quantizations", text])
    assert "argument --quantizations:" in capsys.readouterr().err


def test_agreement_counts_the_draft_argmax_of_every_position() -> None:
    pair = build_pair("llama", seed=2, draft_noise=0.3)
    prompts = [encode_prompt(pair.tokenizer, text) for text in ("hello there", "my order")]
    table = agreement_table(pair.target, {"same": pair.target, "noisy": pair.draft}, prompts, 12)
    assert table["same"] == [1.0, 1.0]  # the target agrees with itself everywhere
    with torch.inference_mode():
        for prompt, measured in zip(prompts, table["noisy"], strict=True):
            continuation = target_greedy(pair.target, prompt, 12)
            # One teacher-forced forward over everything gives the same argmaxes
            # (an fp32 model: one token at a time or all at once round alike here).
            ids = torch.tensor([prompt + continuation])
            logits = pair.draft(ids).logits[0, len(prompt) - 1 : -1]
            expected = (logits.argmax(-1) == torch.tensor(continuation)).float().mean()
            assert measured == pytest.approx(float(expected))
            assert agreement(pair.draft, prompt, continuation) == measured
            one = agreement_in_one_forward(pair.draft, prompt, continuation)
            assert one == pytest.approx(measured)
    assert min(table["noisy"]) < 1.0  # the noisy draft does miss somewhere
    assert "noisy" in format_table(table)
