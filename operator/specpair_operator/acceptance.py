"""Acceptance of the pair's pods, from their Prometheus counters (pure).

The scraper keeps one *anchor* sample per pod: the counters at the start of
the current interval. Each scrape subtracts the anchors from the new
counters and sums over the pods. An interval is published only once it holds
``minDraftedTokens`` drafted tokens (a rate over a handful of tokens is
noise); until then the anchors stay, so the interval grows. A counter that
went down means the runtime restarted, and its whole value is the delta.

Both engines' counters are read: the specpair runtime's ``specpair_*`` and
vLLM's ``vllm:spec_decode_*`` (a pod exports one set). vLLM counts a step
that drafted as a draft (``num_drafts``), its proposed tokens
(``num_draft_tokens``), the accepted ones (``num_accepted_tokens``) and the
accepted ones at each draft position (``num_accepted_tokens_per_pos``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

DRAFTED = "specpair_draft_tokens_total"
ACCEPTED = "specpair_accepted_tokens_total"
STEPS = "specpair_speculation_steps_total"
ENABLED = "specpair_speculation_enabled"
FALLBACK = "specpair_fallback_total"
PER_POSITION = "specpair_accepted_tokens_per_position_total"
# vLLM's spec-decode counters, read into the same fields.
VLLM_DRAFTED = "vllm:spec_decode_num_draft_tokens_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_STEPS = "vllm:spec_decode_num_drafts_total"
VLLM_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
_FIELDS = {
    DRAFTED: DRAFTED,
    ACCEPTED: ACCEPTED,
    STEPS: STEPS,
    ENABLED: ENABLED,
    VLLM_DRAFTED: DRAFTED,
    VLLM_ACCEPTED: ACCEPTED,
    VLLM_STEPS: STEPS,
}


@dataclass(frozen=True)
class PodSample:
    """One pod's counters at one scrape."""

    drafted: float = 0.0
    accepted: float = 0.0
    steps: float = 0.0
    speculating: bool = True
    fallbacks: Mapping[str, float] = field(default_factory=dict)
    per_position: Mapping[int, float] = field(default_factory=dict)  # accepted, by position


@dataclass(frozen=True)
class Window:
    """Acceptance summed over the pods for one interval."""

    drafted: int
    accepted: int
    steps: int
    per_position: tuple[int, ...] = ()  # accepted drafts at each position, position 0 first

    @property
    def position_rates(self) -> list[float]:
        """Accepted drafts at each position per speculation step (vLLM's per-position rate)."""
        return [round(n / self.steps, 4) if self.steps else 0.0 for n in self.per_position]

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.accepted / self.steps if self.steps else 0.0


def _labels(series: str) -> dict[str, str]:
    if "{" not in series:
        return {}
    inner = series.split("{", 1)[1].rstrip("}")
    found: dict[str, str] = {}
    for part in inner.split('",'):
        key, _, value = part.partition("=")
        found[key.strip()] = value.strip().strip('"')
    return found


def parse_metrics(text: str) -> PodSample:
    """The counters the operator needs from an engine's ``/metrics`` text."""
    values: dict[str, float] = {}
    fallbacks: dict[str, float] = {}
    positions: dict[int, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, raw = line.rpartition(" ")
        try:
            value = float(raw)
        except ValueError:
            continue
        name = series.split("{", 1)[0]
        if name == FALLBACK:
            reason = _labels(series).get("reason", "unknown")
            fallbacks[reason] = fallbacks.get(reason, 0.0) + value
        elif name in (PER_POSITION, VLLM_PER_POSITION):
            position = _labels(series).get("position", "")
            if position.isdigit():
                positions[int(position)] = positions.get(int(position), 0.0) + value
        elif name in _FIELDS:
            key = _FIELDS[name]
            values[key] = values.get(key, 0.0) + value
    return PodSample(
        drafted=values.get(DRAFTED, 0.0),
        accepted=values.get(ACCEPTED, 0.0),
        steps=values.get(STEPS, 0.0),
        speculating=values.get(ENABLED, 1.0) >= 1.0,
        fallbacks=fallbacks,
        per_position=positions,
    )


def _delta(now: float, anchor: float) -> float:
    return now if now < anchor else now - anchor  # below the anchor: the pod restarted


def window(anchors: Mapping[str, PodSample], samples: Mapping[str, PodSample]) -> Window:
    """The interval from ``anchors`` to ``samples``; a pod without an anchor counts from 0."""
    drafted = accepted = steps = 0.0
    positions: dict[int, float] = {}
    for pod, sample in samples.items():
        anchor = anchors.get(pod, PodSample())
        drafted += _delta(sample.drafted, anchor.drafted)
        accepted += _delta(sample.accepted, anchor.accepted)
        steps += _delta(sample.steps, anchor.steps)
        for position, count in sample.per_position.items():
            before = anchor.per_position.get(position, 0.0)
            positions[position] = positions.get(position, 0.0) + _delta(count, before)
    per_position = tuple(int(positions.get(i, 0.0)) for i in range(max(positions, default=-1) + 1))
    return Window(int(drafted), int(accepted), int(steps), per_position)


def settled(win: Window, min_drafted_tokens: int) -> bool:
    return win.drafted >= min_drafted_tokens


def drift_threshold(baseline: float, tolerance: float) -> float:
    return baseline * (1.0 - tolerance)


def drifted(rate: float, baseline: float | None, tolerance: float) -> bool:
    """Whether ``rate`` fell below the revision's baseline by more than ``tolerance``."""
    return baseline is not None and rate < drift_threshold(baseline, tolerance)


def off_reason(sample: PodSample, anchor: PodSample | None) -> str:
    """Why a pod is not speculating: the fallback that grew most (or the largest)."""
    before = anchor.fallbacks if anchor is not None else {}
    grown = {r: v - before.get(r, 0.0) for r, v in sample.fallbacks.items()}
    pool = {r: v for r, v in grown.items() if v > 0} or {
        r: v for r, v in sample.fallbacks.items() if v > 0
    }
    if not pool:
        return "disabled"
    return max(sorted(pool), key=lambda r: pool[r])


def speculation_off(
    samples: Mapping[str, PodSample], anchors: Mapping[str, PodSample]
) -> list[tuple[str, str]]:
    """(pod, reason) for each pod whose speculation gauge reads off, sorted by pod."""
    return [
        (pod, off_reason(sample, anchors.get(pod)))
        for pod, sample in sorted(samples.items())
        if not sample.speculating
    ]


def keep_only(anchors: Mapping[str, PodSample], pods: Iterable[str]) -> dict[str, PodSample]:
    """Anchors of the pods still present (deleted pods leave the interval)."""
    wanted = set(pods)
    return {pod: sample for pod, sample in anchors.items() if pod in wanted}
