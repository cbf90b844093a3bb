"""Run a golden-prompt file against a pair: speculative == target-only up to numerics.

Each prompt is decoded greedily twice, through a speculative engine and a
target-only engine over the same models, and the text must satisfy the
file's expectations. Used by ``specpair-runtime check --golden`` and by the
server's /readyz gate.

Greedy speculation is lossless, but "equal" holds only up to floating-point
numerics. On the CPU both paths run the same kernels, so the token ids must be
identical. In bf16 on CUDA a (k+1)-token verify and a 1-token step use
different kernels, and a near-tie between the target's two best tokens may
flip. So the outputs are compared up to their first divergence, and a
divergence passes only at a near-tie: the target, teacher-forced on the prompt
plus the target-only output (one plain forward, independent of the engine),
must rank both tokens within ``near_tie_margin`` logits of its top logit there.
When the two tokens are its top two, that is its top-2 margin. Anything else
fails and names the prompt, the position, both tokens and the margin.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from specpair_runtime.engine.api import Engine, SamplingParams
from specpair_runtime.engine.loading import LoadedModel
from specpair_runtime.engine.oneshot import Completion, run_request
from specpair_runtime.engine.options import EngineOptions
from specpair_runtime.engine.pair import LoadedPair
from specpair_runtime.engine.prefix_reuse import common_prefix_length
from specpair_runtime.engine.prompting import PromptError, encode_prompt
from specpair_runtime.golden import GoldenFile, GoldenPrompt, check_expectation

# The default near-tie margin on CUDA, in logits (the target's raw scores).
# bf16 keeps 8 significant bits, so a top logit near 20 moves in steps of
# 0.125. Measured on the real 1.5B target in bf16 (docs/architecture.md), the
# logits of 1-token steps, 5-token verify chunks and one full forward differ
# by at most 0.25; a flip needs the two paths to move the margin apart, so
# 0.5 logits (a probability ratio of e^0.5 ≈ 1.65) covers it and still fails
# any divergence where the target clearly preferred one token. Set
# ``nearTieMargin`` in the golden file to change it; 0 demands exact identity.
CUDA_NEAR_TIE_MARGIN = 0.5


def near_tie_margin(configured: float | None, device: torch.device) -> float:
    """The margin in force: the configured one, else exact (0) on the CPU and 0.5 on CUDA."""
    if configured is not None:
        return configured
    return 0.0 if device.type == "cpu" else CUDA_NEAR_TIE_MARGIN


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where two token lists differ, None when equal."""
    shared = common_prefix_length(a, b)
    return None if shared == len(a) == len(b) else shared


def next_token_logits(target: LoadedModel, context_ids: list[int]) -> torch.Tensor:
    """The target's raw next-token logits after ``context_ids`` (one cache-free forward)."""
    input_ids = torch.tensor([context_ids], dtype=torch.long, device=target.device)
    with torch.inference_mode():
        output = target.model(input_ids=input_ids, use_cache=False)
    logits: torch.Tensor = output.logits[0, -1].float().cpu()
    return logits


@dataclass(frozen=True)
class Divergence:
    """Where speculative and target-only greedy output first differ, and how close a call it was.

    A token is None where that output had already ended. ``margin`` is how far
    the lower-scored of the two tokens lies below the target's top logit;
    ``top2_margin`` is the target's top-1 minus top-2 logit. Both are None when
    a token is missing (no tie can explain an output that stops early).
    """

    position: int
    speculative_token: int | None
    target_token: int | None
    margin: float | None
    top2_margin: float | None
    tolerance: float

    @property
    def tolerated(self) -> bool:
        return self.margin is not None and self.margin < self.tolerance

    def describe(self, tokenizer: Any) -> str:
        def token(token_id: int | None) -> str:
            if token_id is None:
                return "end of output"
            return f"{tokenizer.decode([token_id])!r} (id {token_id})"

        where = (
            f"at token {self.position}: speculative {token(self.speculative_token)}, "
            f"target-only {token(self.target_token)}"
        )
        if self.margin is None or self.top2_margin is None:
            return f"{where}; one output ended early, which no near-tie explains"
        numbers = (
            f"the target's margin between them is {self.margin:.4g} logits "
            f"(top-2 margin {self.top2_margin:.4g})"
        )
        if self.tolerated:
            return f"{where}; {numbers} < near-tie margin {self.tolerance:g}"
        limit = "exact identity required" if self.tolerance == 0 else "not a near-tie"
        return f"{where}; {numbers}, {limit} (near-tie margin {self.tolerance:g})"

    def to_dict(self) -> dict[str, object]:
        return {
            "position": self.position,
            "speculative_token": self.speculative_token,
            "target_token": self.target_token,
            "margin": self.margin,
            "top2_margin": self.top2_margin,
            "tolerance": self.tolerance,
            "tolerated": self.tolerated,
        }


def judge_divergence(
    target: LoadedModel,
    prompt_ids: list[int],
    speculative_ids: list[int],
    target_ids: list[int],
    tolerance: float,
) -> Divergence | None:
    """The first divergence of the two greedy outputs, judged by the target; None if equal."""
    position = first_difference(speculative_ids, target_ids)
    if position is None:
        return None
    spec_token = speculative_ids[position] if position < len(speculative_ids) else None
    target_token = target_ids[position] if position < len(target_ids) else None
    if spec_token is None or target_token is None:
        return Divergence(position, spec_token, target_token, None, None, tolerance)
    logits = next_token_logits(target, prompt_ids + target_ids[:position])
    top = logits.max()
    margin = float(top - torch.minimum(logits[spec_token], logits[target_token]))
    best_two = torch.topk(logits, 2).values
    return Divergence(
        position,
        spec_token,
        target_token,
        margin,
        float(best_two[0] - best_two[1]),
        tolerance,
    )


@dataclass(frozen=True)
class PromptResult:
    name: str
    passed: bool
    failures: list[str]
    text: str
    token_ids: list[int]
    baseline_token_ids: list[int]
    drafted_tokens: int
    accepted_tokens: int
    divergence: Divergence | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "passed": self.passed,
            "failures": list(self.failures),
            "notes": list(self.notes),
            "text": self.text,
            "token_ids": list(self.token_ids),
            "baseline_token_ids": list(self.baseline_token_ids),
            "divergence": None if self.divergence is None else self.divergence.to_dict(),
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
        }


@dataclass(frozen=True)
class GoldenReport:
    near_tie_margin: float = 0.0
    results: list[PromptResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(result.passed for result in self.results)

    def failures(self) -> list[str]:
        """One line per failed check, prefixed with the prompt's name."""
        return [f"{r.name}: {failure}" for r in self.results for failure in r.failures]

    def notes(self) -> list[str]:
        """One line per tolerated near-tie, prefixed with the prompt's name."""
        return [f"{r.name}: {note}" for r in self.results for note in r.notes]


def encode_all(golden: GoldenFile, tokenizer: Any) -> list[list[int] | str]:
    """Each prompt's token ids, or why it cannot be encoded."""
    encoded: list[list[int] | str] = []
    for prompt in golden.prompts:
        try:
            encoded.append(encode_prompt(tokenizer, prompt.prompt, chat=prompt.chat))
        except PromptError as error:
            encoded.append(str(error))
    return encoded


def decode_all(
    engine: Engine, golden: GoldenFile, encoded: list[list[int] | str]
) -> list[Completion | None]:
    """Greedy completions of the encodable prompts, one request at a time."""
    completions: list[Completion | None] = []
    for prompt, ids in zip(golden.prompts, encoded, strict=True):
        params = SamplingParams(max_new_tokens=prompt.max_new_tokens, temperature=0.0)
        completions.append(None if isinstance(ids, str) else run_request(engine, ids, params))
    return completions


def _errored(completion: Completion, which: str) -> list[str]:
    if completion.finish_reason == "error":
        return [f"the {which} decode failed inside the engine"]
    return []


def check_prompt(
    prompt: GoldenPrompt,
    target: LoadedModel,
    prompt_ids: list[int],
    spec: Completion,
    base: Completion,
    tolerance: float,
) -> PromptResult:
    """Compare one prompt's speculative and target-only completions; collect failed checks."""
    failures = _errored(spec, "speculative") + _errored(base, "target-only")
    notes = []
    divergence = judge_divergence(target, prompt_ids, spec.token_ids, base.token_ids, tolerance)
    if divergence is not None:
        line = divergence.describe(target.tokenizer)
        if divergence.tolerated:
            notes.append(f"near-tie {line}; outputs not compared beyond it")
        else:
            failures.append(f"speculative output differs from target-only output {line}")
    failures += check_expectation(prompt.expect, spec.text)
    return PromptResult(
        name=prompt.name,
        passed=not failures,
        failures=failures,
        text=spec.text,
        token_ids=spec.token_ids,
        baseline_token_ids=base.token_ids,
        drafted_tokens=spec.stats.drafted_tokens,
        accepted_tokens=spec.stats.accepted_tokens,
        divergence=divergence,
        notes=notes,
    )


def _report(
    golden: GoldenFile,
    target: LoadedModel,
    encoded: list[list[int] | str],
    speculative: list[Completion | None],
    baseline: list[Completion | None],
) -> GoldenReport:
    tolerance = near_tie_margin(golden.near_tie_margin, target.device)
    results = []
    for prompt, ids, spec, base in zip(golden.prompts, encoded, speculative, baseline, strict=True):
        if isinstance(ids, str) or spec is None or base is None:
            results.append(PromptResult(prompt.name, False, [str(ids)], "", [], [], 0, 0))
        else:
            results.append(check_prompt(prompt, target, ids, spec, base, tolerance))
    return GoldenReport(tolerance, results)


def run_golden_with(
    golden: GoldenFile, target: LoadedModel, speculative: Engine, baseline: Engine
) -> GoldenReport:
    """Check every prompt with the given engines (speculative and target-only).

    ``speculative is baseline`` (a pair that cannot speculate) decodes once.
    """
    encoded = encode_all(golden, target.tokenizer)
    spec = decode_all(speculative, golden, encoded)
    base = spec if baseline is speculative else decode_all(baseline, golden, encoded)
    return _report(golden, target, encoded, spec, base)


def one_request_options(
    pair: LoadedPair, golden: GoldenFile, encoded: list[list[int] | str]
) -> EngineOptions:
    """The pair's engine options with KV storage for one golden prompt at a time."""
    lengths = [
        len(ids) + prompt.max_new_tokens
        for prompt, ids in zip(golden.prompts, encoded, strict=True)
        if not isinstance(ids, str)
    ]
    return replace(pair.options, max_slots=1, max_length=max([2, *lengths]))


def run_golden(golden: GoldenFile, pair: LoadedPair) -> GoldenReport:
    """Check every prompt with fresh engines over the pair's loaded models.

    The engines hold KV storage for one request, and live one after the other,
    so the check needs far less device memory than serving does.
    """
    encoded = encode_all(golden, pair.target.tokenizer)
    options = one_request_options(pair, golden, encoded)
    spec = decode_all(pair.engine(options=options), golden, encoded)
    if pair.draft is None:  # pair.engine() was already target-only
        return _report(golden, pair.target, encoded, spec, spec)
    gc.collect()  # free the speculative engine's storage before the next one takes its own
    base = decode_all(pair.engine(speculate=False, options=options), golden, encoded)
    gc.collect()  # and this one's, before the server builds its serving engine
    return _report(golden, pair.target, encoded, spec, base)
