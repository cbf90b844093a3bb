"""Run a golden-prompt file against a pair: speculative == target-only, and expectations hold.

Each prompt is decoded greedily twice, through a speculative engine and a
target-only engine over the same models. The token ids must be identical
(greedy speculation is lossless) and the text must satisfy the file's
expectations. Used by ``specpair-runtime check`` and by the server's /readyz.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specpair_runtime.engine.api import Engine, SamplingParams
from specpair_runtime.engine.oneshot import run_request
from specpair_runtime.engine.pair import LoadedPair
from specpair_runtime.engine.prompting import PromptError, encode_prompt
from specpair_runtime.golden import GoldenFile, GoldenPrompt, check_expectation


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

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "passed": self.passed,
            "failures": list(self.failures),
            "text": self.text,
            "token_ids": list(self.token_ids),
            "baseline_token_ids": list(self.baseline_token_ids),
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
        }


@dataclass(frozen=True)
class GoldenReport:
    results: list[PromptResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(result.passed for result in self.results)

    def failures(self) -> list[str]:
        """One line per failed check, prefixed with the prompt's name."""
        return [f"{r.name}: {failure}" for r in self.results for failure in r.failures]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where two token lists differ, None when equal."""
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def check_prompt(
    prompt: GoldenPrompt, tokenizer: Any, speculative: Engine, baseline: Engine
) -> PromptResult:
    """Decode one golden prompt both ways and collect every failed check."""
    try:
        prompt_ids = encode_prompt(tokenizer, prompt.prompt, chat=prompt.chat)
    except PromptError as error:
        return PromptResult(prompt.name, False, [str(error)], "", [], [], 0, 0)
    params = SamplingParams(max_new_tokens=prompt.max_new_tokens, temperature=0.0)
    spec = run_request(speculative, prompt_ids, params)
    base = run_request(baseline, prompt_ids, params)
    failures = []
    index = first_difference(spec.token_ids, base.token_ids)
    if index is not None:
        failures.append(
            f"speculative output differs from target-only output at token {index} "
            f"({len(spec.token_ids)} vs {len(base.token_ids)} tokens)"
        )
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
    )


def run_golden_with(
    golden: GoldenFile, tokenizer: Any, speculative: Engine, baseline: Engine
) -> GoldenReport:
    """Check every prompt with the given engines (speculative and target-only)."""
    return GoldenReport(
        [check_prompt(prompt, tokenizer, speculative, baseline) for prompt in golden.prompts]
    )


def run_golden(golden: GoldenFile, pair: LoadedPair) -> GoldenReport:
    """Check every prompt with fresh engines over the pair's loaded models."""
    return run_golden_with(
        golden, pair.target.tokenizer, pair.engine(), pair.engine(speculate=False)
    )
