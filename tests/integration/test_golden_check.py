"""Golden-prompt checks over real engines on tiny in-memory models.

The near-tie tests force a divergence with a real tiny target: either a
hand-made speculative sequence that takes the target's second-best token, or
a target-only engine over a copy of the target whose LM head is nudged just
enough to flip one greedy token. The margins are measured, so each test sets
its tolerance just above or just below the real margin.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import yaml
from tools.tiny_models import as_loaded, build_pair

from specpair_runtime import cli
from specpair_runtime.config import ConfigError, SpeculationKnobs
from specpair_runtime.engine.api import SamplingParams
from specpair_runtime.engine.golden_check import (
    CUDA_NEAR_TIE_MARGIN,
    Divergence,
    encode_all,
    first_difference,
    judge_divergence,
    near_tie_margin,
    next_token_logits,
    one_request_options,
    run_golden,
    run_golden_with,
)
from specpair_runtime.engine.loading import CpuKernels, LoadedModel
from specpair_runtime.engine.oneshot import run_request
from specpair_runtime.engine.options import EngineOptions
from specpair_runtime.engine.pair import LoadedPair, check_pair
from specpair_runtime.engine.prompting import encode_prompt
from specpair_runtime.golden import GoldenFile, parse_golden

KNOBS = SpeculationKnobs(max_depth=3)
PROMPT = "Hello, how can"


def tiny_pair(seed: int = 0, cpu_kernels: CpuKernels = "onednn") -> LoadedPair:
    tiny = build_pair("llama", seed)
    target = as_loaded(tiny.target, tiny.tokenizer, "target", cpu_kernels=cpu_kernels)
    draft = as_loaded(tiny.draft, tiny.tokenizer, "draft", cpu_kernels=cpu_kernels)
    return LoadedPair(target, draft, check_pair(target, draft), KNOBS)


def target_only(model: LoadedModel) -> LoadedPair:
    return LoadedPair(model, None, None, KNOBS)


def golden(expect: dict[str, object], chat: bool = False, **extra: object) -> GoldenFile:
    return parse_golden(
        {
            "prompts": [
                {"name": "p1", "prompt": PROMPT, "maxNewTokens": 10, "expect": expect},
                {"name": "p2", "prompt": "Where is my order?", "chat": chat, "maxNewTokens": 6},
            ],
            **extra,
        }
    )


def greedy(pair: LoadedPair, prompt_ids: list[int], tokens: int) -> list[int]:
    params = SamplingParams(max_new_tokens=tokens, temperature=0.0)
    return run_request(pair.engine(speculate=False), prompt_ids, params).token_ids


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_near_tie_margin_is_exact_on_the_cpu_by_default() -> None:
    assert near_tie_margin(None, torch.device("cpu")) == 0.0
    assert near_tie_margin(None, torch.device("cuda", 0)) == CUDA_NEAR_TIE_MARGIN
    assert near_tie_margin(0.25, torch.device("cpu")) == 0.25
    assert near_tie_margin(0.0, torch.device("cuda", 0)) == 0.0
    assert golden({}).near_tie_margin is None
    assert golden({}, nearTieMargin=0.3).near_tie_margin == 0.3
    with pytest.raises(ConfigError, match="nearTieMargin: Input should be greater than or equal"):
        golden({}, nearTieMargin=-0.1)


def test_golden_passes_when_speculation_matches_and_expectations_hold() -> None:
    pair = tiny_pair()
    first = run_golden(
        parse_golden({"prompts": [{"name": "p", "prompt": PROMPT, "maxNewTokens": 10}]}), pair
    )
    text = first.results[0].text
    assert text, "the tiny target produced no text"
    report = run_golden(golden({"equals": text, "notContains": ["zzz"]}, chat=True), pair)
    assert report.passed, report.failures()
    assert report.near_tie_margin == 0.0  # exact identity on the CPU
    assert [r.name for r in report.results] == ["p1", "p2"]
    assert all(r.token_ids == r.baseline_token_ids for r in report.results)
    assert all(r.divergence is None and not r.notes for r in report.results)
    assert report.results[0].drafted_tokens > 0


def test_golden_names_failed_expectations() -> None:
    report = run_golden(golden({"contains": ["refund-zzz"], "regex": "^\\d+$"}), tiny_pair())
    assert not report.passed
    assert report.failures() == [
        "p1: output does not contain 'refund-zzz'",
        "p1: output does not match regex '^\\\\d+$'",
    ]
    assert report.results[1].passed


def test_golden_fails_a_divergence_that_is_no_near_tie() -> None:
    # A target-only engine over a *different* target stands in for a broken speculator.
    # Even a generous near-tie margin does not excuse tokens the target clearly ranks apart.
    pair, other = tiny_pair(0), tiny_pair(7)
    report = run_golden_with(
        golden({}, nearTieMargin=0.5),
        pair.target,
        other.engine(speculate=False),
        pair.engine(speculate=False),
    )
    assert not report.passed
    result = report.results[0]
    assert result.divergence is not None and not result.divergence.tolerated
    assert result.divergence.margin is not None and result.divergence.margin >= 0.5
    position = result.divergence.position
    failure = report.failures()[0]
    assert failure.startswith(
        f"p1: speculative output differs from target-only output at token {position}: "
        f"speculative {pair.target.tokenizer.decode([result.token_ids[position]])!r} "
        f"(id {result.token_ids[position]}), target-only "
    )
    assert f"margin between them is {result.divergence.margin:.4g} logits" in failure
    assert "not a near-tie (near-tie margin 0.5)" in failure


def test_margin_is_the_targets_teacher_forced_logit_gap() -> None:
    pair = tiny_pair()
    tokenizer = pair.target.tokenizer
    prompt_ids = encode_prompt(tokenizer, PROMPT)
    base = greedy(pair, prompt_ids, 8)
    # Logits from one forward over the whole sequence: a different path than the
    # check's prefix forward, so an off-by-one in the context would show.
    with torch.inference_mode():
        full = pair.target.model(input_ids=torch.tensor([prompt_ids + base])).logits[0].float()
    rows = full[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(base)]
    assert rows.argmax(dim=-1).tolist() == base  # the engine's greedy output is the argmax
    top2 = torch.topk(rows, 2).values
    position = int((top2[:, 0] - top2[:, 1]).argmin())  # the closest call in the output
    second = int(torch.topk(rows[position], 2).indices[1])
    top2_margin = float(top2[position, 0] - top2[position, 1])
    assert torch.allclose(
        next_token_logits(pair.target, prompt_ids + base[:position]), rows[position], atol=1e-4
    )
    # The speculative side took the runner-up at `position`, then went its own way.
    flipped = [*base[:position], second, *base[position:]]

    def judge(tolerance: float, spec: list[int] = flipped) -> Divergence:
        divergence = judge_divergence(pair.target, prompt_ids, spec, base, tolerance)
        assert divergence is not None
        return divergence

    near = judge(top2_margin * 1.01)
    assert near.tolerated and near.position == position and near.speculative_token == second
    assert near.margin == pytest.approx(top2_margin, abs=1e-4)
    assert near.top2_margin == pytest.approx(top2_margin, abs=1e-4)
    assert not judge(top2_margin * 0.99).tolerated
    assert not judge(0.0).tolerated
    # The target's *worst* token at that position is no near-tie, whatever the top-2 margin.
    worst = int(rows[position].argmin())
    far = judge(top2_margin * 1.01, [*base[:position], worst])
    assert not far.tolerated
    assert far.margin == pytest.approx(float(rows[position].max() - rows[position].min()), 1e-4)
    # An output that stops early is never a near-tie.
    short = judge(1e9, base[:position])
    assert short.speculative_token is None and not short.tolerated
    assert judge_divergence(pair.target, prompt_ids, base, base, 1e9) is None


def flip_first_token(target: LoadedModel, prompt_ids: list[int]) -> tuple[LoadedModel, float]:
    """A copy of ``target`` whose first greedy token after ``prompt_ids`` is its runner-up.

    Raises the runner-up's LM-head row along the final hidden state of the
    prompt's last position, by twice the top-2 margin there (room for bf16
    rounding). Returns the copy and the margin.
    """
    model = target.model
    captured: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, args, _o: captured.append(args[0]))
    try:
        logits = next_token_logits(target, prompt_ids)
    finally:
        hook.remove()
    hidden = captured[0][0, -1].float()
    best = torch.topk(logits, 2)
    margin = float(best.values[0] - best.values[1])
    nudge = hidden * (margin * 2) / hidden.dot(hidden)  # raises that logit by 2 x margin
    flipped = copy.deepcopy(model)
    with torch.no_grad():
        flipped.lm_head.weight[int(best.indices[1])] += nudge
    copied = LoadedModel(flipped, target.tokenizer, target.device, target.dtype, "flipped", "x")
    return copied, margin


def on_cuda_bf16(pair: LoadedPair) -> LoadedPair:
    """The tiny pair moved to CUDA in bfloat16, as the loader would place it there."""

    def moved(model: LoadedModel) -> LoadedModel:
        module = model.model.to(device="cuda", dtype=torch.bfloat16)
        return LoadedModel(module, model.tokenizer, torch.device("cuda"), torch.bfloat16, "m", "x")

    assert pair.draft is not None
    target, draft = moved(pair.target), moved(pair.draft)
    return LoadedPair(target, draft, check_pair(target, draft), KNOBS)


@pytest.mark.parametrize(
    "place", [pytest.param(False, id="cpu"), pytest.param(True, id="cuda", marks=pytest.mark.cuda)]
)
def test_golden_tolerates_a_near_tie_flip_and_names_it(place: bool) -> None:
    # Plain linears, so that a copy's weight can be nudged (and moved to CUDA).
    plain = tiny_pair(cpu_kernels="default")
    pair = on_cuda_bf16(plain) if place else plain
    prompt_ids = encode_prompt(pair.target.tokenizer, PROMPT)
    flipped, margin = flip_first_token(pair.target, prompt_ids)
    flipped_ids = greedy(target_only(flipped), prompt_ids, 10)
    base_ids = greedy(pair, prompt_ids, 10)
    assert first_difference(flipped_ids, base_ids) == 0, "the nudge did not flip token 0"

    def check(tolerance: float) -> tuple[bool, list[str], list[str]]:
        one_prompt = {"name": "p1", "prompt": PROMPT, "maxNewTokens": 10}
        report = run_golden_with(
            parse_golden({"prompts": [one_prompt], "nearTieMargin": tolerance}),
            pair.target,
            target_only(flipped).engine(speculate=False),
            pair.engine(speculate=False),
        )
        return report.passed, report.failures(), report.notes()

    passed, failures, notes = check(margin * 1.01)
    assert passed, failures
    assert len(notes) == 1 and notes[0].startswith("p1: near-tie at token 0: speculative ")
    assert f"< near-tie margin {margin * 1.01:g}; outputs not compared beyond it" in notes[0]

    passed, failures, notes = check(margin * 0.99)
    assert not passed and not notes
    assert failures[0].startswith("p1: speculative output differs from target-only output at ")
    assert "at token 0: speculative " in failures[0]
    assert "not a near-tie" in failures[0]

    passed, failures, _ = check(0.0)
    assert not passed and "exact identity required (near-tie margin 0)" in failures[0]


def test_golden_chat_prompt_without_template_fails_with_reason() -> None:
    pair = tiny_pair()
    pair.target.tokenizer.chat_template = None
    report = run_golden(golden({}, chat=True), pair)
    assert report.results[1].failures == [
        "the target tokenizer has no chat template, so a chat prompt cannot be encoded"
    ]


def test_target_only_pair_decodes_once_and_checks_expectations() -> None:
    pair = tiny_pair()
    report = run_golden(golden({"contains": ["refund-zzz"]}), target_only(pair.target))
    assert report.failures() == ["p1: output does not contain 'refund-zzz'"]
    assert report.results[0].token_ids == report.results[0].baseline_token_ids
    assert report.results[0].drafted_tokens == 0


def test_the_check_command_reports_the_margin_in_force(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "golden.yaml"
    prompts = [{"name": "p", "prompt": PROMPT, "maxNewTokens": 6}]
    path.write_text(yaml.safe_dump({"prompts": prompts, "nearTieMargin": 0.25}))
    target, draft = pair
    argv = ["check", "--target", str(target), "--draft", str(draft), "--golden", str(path)]
    assert cli.main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["near_tie_margin"] == 0.25
    prompt = report["prompts"][0]
    assert prompt["divergence"] is None and prompt["notes"] == []
    assert prompt["token_ids"] == prompt["baseline_token_ids"]


def test_golden_engines_hold_storage_for_one_request() -> None:
    pair = tiny_pair()
    pair.options = EngineOptions(max_slots=8, max_length=2048, max_step_tokens=16)
    file = golden({}, chat=True)
    encoded = encode_all(file, pair.target.tokenizer)
    lengths = [len(ids) + p.max_new_tokens for p, ids in zip(file.prompts, encoded, strict=True)]
    assert one_request_options(pair, file, encoded) == EngineOptions(
        max_slots=1, max_length=max(lengths), max_step_tokens=16
    )
