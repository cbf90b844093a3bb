"""A request's choices: one generation per prompt and sample, gathered into one answer.

``n`` choices per prompt, for every prompt of the request; choice ``index``
is ``prompt * n + sample`` (``prompt_inputs.choice_index``). Usage counts
each prompt once (its choices share its KV: one read it, the others reused
it) and every choice's completion tokens.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from specpair_runtime.engine.api import FinishReason
from specpair_runtime.server.generation import Generation
from specpair_runtime.server.schemas import PromptTokensDetails, SpeculationStats, Usage


@dataclass(frozen=True)
class Choice:
    index: int
    prompt_index: int
    generation: Generation
    echo: str = ""  # text put before the completion (``echo``)


def combined_usage(choices: list[Choice]) -> Usage:
    prompts: dict[int, tuple[int, int]] = {}  # prompt index -> (tokens, cached)
    completion = 0
    for choice in choices:
        generation = choice.generation
        completion += generation.completion_tokens
        tokens, cached = prompts.get(choice.prompt_index, (generation.prompt_tokens, 1 << 62))
        # The prompt was read once: by the choice that reused the least of it.
        prompts[choice.prompt_index] = (tokens, min(cached, generation.cached_tokens))
    prompt_tokens = sum(tokens for tokens, _ in prompts.values())
    cached_tokens = sum(cached for _, cached in prompts.values())
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def combined_speculation(choices: list[Choice]) -> SpeculationStats:
    drafted = sum(c.generation.drafted for c in choices)
    accepted = sum(c.generation.accepted for c in choices)
    steps = sum(c.generation.steps for c in choices)
    rate = accepted / drafted if drafted else 0.0
    return SpeculationStats(drafted=drafted, accepted=accepted, acceptance_rate=rate, steps=steps)


def abort_all(choices: list[Choice]) -> None:
    for choice in choices:
        choice.generation.abort()


async def collect_all(
    choices: list[Choice], disconnected: asyncio.Event
) -> list[tuple[str, FinishReason]]:
    """Every choice's whole text and finish reason; the first failure aborts the rest."""
    tasks = [asyncio.ensure_future(c.generation.collect(disconnected)) for c in choices]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        abort_all(choices)
        raise
