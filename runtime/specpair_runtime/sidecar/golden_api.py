"""Golden prompts through an engine's OpenAI API: the runtime's golden check, for vLLM.

For each prompt of the file:

1. the engine tokenizes it (``/tokenize``; a chat prompt through the target's
   chat template, as the runtime renders it);
2. the engine decodes it greedily (``/v1/completions``, temperature 0): the
   speculative output whose tokens the gate judges;
3. the engine scores prompt + output once more with ``prompt_logprobs``. A
   prompt's log-probabilities come from the target's own forward over the
   whole sequence: the draft takes no part. So at each output position the
   target's greedy choice is the rank-1 token there, and lossless greedy
   speculation must have emitted exactly it. The first token that is not
   rank 1 passes only at a near-tie (it lies less than ``nearTieMargin``
   below the top log-probability there: log-probabilities and logits differ
   by one constant per position) and ends the comparison, as in
   ``engine/golden_check.py``; anything else fails and names the prompt, the
   position, both tokens and the margin;
4. the file's expectations are checked on the output text.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from specpair_runtime.golden import GoldenFile, GoldenPrompt, check_expectation

# 0.5 logits on CUDA, as engine/golden_check.py (bf16 kernels differ). On the CPU the
# runtime demands exact identity because both of its paths run the same kernels; here the
# output comes from vLLM's decode and verify steps and the judgement from one prefill over
# the whole sequence, whose fp32 sums run in another order (differences of about 1e-5
# logits), so a true tie may split either way: 0.05 logits tolerates that and nothing else.
CUDA_NEAR_TIE_MARGIN = 0.5
CPU_NEAR_TIE_MARGIN = 0.05


def near_tie_margin(configured: float | None, *, cuda: bool) -> float:
    if configured is not None:
        return configured
    return CUDA_NEAR_TIE_MARGIN if cuda else CPU_NEAR_TIE_MARGIN


class EngineError(RuntimeError):
    """The engine did not answer as its OpenAI API promises; the message says what."""


@dataclass(frozen=True)
class EngineClient:
    """The few calls of an OpenAI-compatible server (vLLM's) the gate needs."""

    base_url: str
    model: str
    api_key: str | None = None
    timeout: float = 300.0

    def _request(self, path: str, body: Mapping[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(
            self.base_url.rstrip("/") + path,
            data=data,
            method="GET" if body is None else "POST",
            headers=headers,
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                return json.loads(reply.read() or b"null")
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:500]
            raise EngineError(f"POST {path}: HTTP {error.code}: {detail}") from None
        except (OSError, ValueError) as error:
            raise EngineError(f"{path}: {error}") from None

    def healthy(self) -> bool:
        request = urllib.request.Request(self.base_url.rstrip("/") + "/health")
        try:
            with urllib.request.urlopen(request, timeout=5) as reply:
                return bool(reply.status == 200)
        except (OSError, ValueError):
            return False

    def tokenize(self, prompt: GoldenPrompt) -> list[int]:
        body: dict[str, Any] = {"model": self.model}
        if prompt.chat:
            body["messages"] = [{"role": "user", "content": prompt.prompt}]
            body["add_generation_prompt"] = True
        else:
            body["prompt"] = prompt.prompt
        reply = self._request("/tokenize", body)
        return [int(t) for t in reply["tokens"]]

    def greedy(self, prompt_ids: Sequence[int], max_tokens: int) -> tuple[list[int], str]:
        reply = self._request(
            "/v1/completions",
            {
                "model": self.model,
                "prompt": list(prompt_ids),
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "return_token_ids": True,
            },
        )
        choice = reply["choices"][0]
        return [int(t) for t in choice["token_ids"]], str(choice["text"])

    def prompt_logprobs(self, ids: Sequence[int]) -> list[Mapping[str, Any] | None]:
        reply = self._request(
            "/v1/completions",
            {
                "model": self.model,
                "prompt": list(ids),
                "max_tokens": 1,
                "temperature": 0.0,
                "prompt_logprobs": 1,
            },
        )
        found: list[Mapping[str, Any] | None] = reply["choices"][0]["prompt_logprobs"]
        if len(found) != len(ids):
            raise EngineError(f"prompt_logprobs has {len(found)} entries for {len(ids)} tokens")
        return found


@dataclass(frozen=True)
class Judgement:
    """Where the output departs from the target's greedy choice, if it does."""

    problem: str | None = None  # a failure
    note: str | None = None  # a tolerated near-tie


def _describe(entry: Mapping[str, Any], token: int) -> str:
    found = entry.get(str(token)) or {}
    return f"{found.get('decoded_token')!r} ({token})"


def judge(
    prompt_length: int,
    output: Sequence[int],
    logprobs: Sequence[Mapping[str, Any] | None],
    margin: float,
) -> Judgement:
    """Judge the output token by token against the target's teacher-forced ranks."""
    for index, token in enumerate(output):
        entry = logprobs[prompt_length + index] or {}
        mine = entry.get(str(token))
        if mine is None:
            return Judgement(problem=f"position {index}: no log-probability for token {token}")
        if int(mine.get("rank") or 0) == 1:
            continue
        best_id, best = max(entry.items(), key=lambda item: float(item[1]["logprob"]))
        gap = float(best["logprob"]) - float(mine["logprob"])
        where = (
            f"position {index}: the engine emitted {_describe(entry, token)} where the "
            f"target's greedy choice is {_describe(entry, int(best_id))}, "
            f"{gap:.4f} logits below it"
        )
        if gap < margin:
            return Judgement(note=f"{where}: a near-tie (margin {margin:g}); not compared further")
        return Judgement(problem=f"{where} (nearTieMargin {margin:g})")
    return Judgement()


@dataclass(frozen=True)
class PromptOutcome:
    name: str
    text: str
    problems: list[str]
    note: str | None = None

    @property
    def passed(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class GoldenOutcome:
    prompts: list[PromptOutcome] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(p.passed for p in self.prompts)

    def failures(self) -> list[str]:
        return [f"{p.name}: {'; '.join(p.problems)}" for p in self.prompts if not p.passed]

    def notes(self) -> list[str]:
        return [f"{p.name}: {p.note}" for p in self.prompts if p.note]


def check_prompt(client: EngineClient, prompt: GoldenPrompt, margin: float) -> PromptOutcome:
    try:
        prompt_ids = client.tokenize(prompt)
        output, text = client.greedy(prompt_ids, prompt.max_new_tokens)
        scores = client.prompt_logprobs([*prompt_ids, *output])
    except EngineError as error:
        return PromptOutcome(prompt.name, "", [f"engine error: {error}"])
    verdict = judge(len(prompt_ids), output, scores, margin)
    problems = [verdict.problem] if verdict.problem else []
    problems += check_expectation(prompt.expect, text)
    return PromptOutcome(prompt.name, text, problems, verdict.note)


def run_golden_api(golden: GoldenFile, client: EngineClient, *, cuda: bool) -> GoldenOutcome:
    margin = near_tie_margin(golden.near_tie_margin, cuda=cuda)
    return GoldenOutcome([check_prompt(client, prompt, margin) for prompt in golden.prompts])
