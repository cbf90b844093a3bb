"""Is the draft helping? The ``SpeculationEffective`` condition (pure).

Read from the scraped interval in ``status.acceptance`` (`scraper.py`) and
the knobs in force. The pair keeps serving the target's output either way;
the condition says whether the draft earns its keep:

- ``False, SpeculationOff``: the knobs turn speculation off (the spec, or a
  ``TargetOnly`` placement);
- ``False, RuntimeFellBack``: the runtime itself turned speculation off on
  a pod because its rolling acceptance fell below
  ``speculation.acceptanceFloor`` (the pod serves target-only until the knobs
  change or it restarts);
- ``Unknown, NotMeasured``: fewer than ``acceptanceDrift.minDraftedTokens``
  drafted tokens since the current revision serves;
- ``False, LowAcceptance``: over an interval of at least that many drafted
  tokens, acceptance stayed below the break-even rate (below) or below
  ``speculation.acceptanceFloor``: the drafts cost more than they save;
- ``False, MostlyTargetOnly``: most tokens came from target-only steps (the
  runtime's cost model found the draft not paying, a pause, or steps that
  read prompts): the draft is rarely used;
- ``True, Effective`` otherwise.

Break-even: a decode step reads every weight once, so its time goes with the
bytes of the weights it reads. A speculation step of depth d costs d draft
forwards (each about ``c`` = draft bytes / target bytes of a target forward)
plus one verify pass (at least one target forward) and commits its accepted
drafts plus one token. It beats d target-only steps' worth only if the
acceptance rate exceeds ``c``. The verify pass of d + 1 tokens costs more
than one forward, and a small draft's forward more than its bytes (launch
overhead), so the true break-even is higher: a rate below ``c`` certainly
does not pay.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specpair_operator.api import PairModel, SpeculativePairSpec
from specpair_operator.conditions import SPECULATION_EFFECTIVE, ConditionUpdate
from specpair_runtime.planner import dtype_bytes

# Below this share of tokens from speculating steps the draft is rarely used.
MOSTLY_TARGET_ONLY_SHARE = 0.5
# The reasons that mean "still serving, but the draft is not helping": a Warning Event.
NOT_HELPING = ("RuntimeFellBack", "LowAcceptance", "MostlyTargetOnly")
# Bytes a decode step reads per weight of a quantized draft: int8 codes, int4 codes.
_READ_BYTES = {"int8-dynamic": 1.0, "int4-weight": 0.5}


def _read_bytes(model: PairModel, *, cuda: bool) -> float:
    per_weight = _READ_BYTES.get(model.quantization, float(dtype_bytes(model.dtype, cuda=cuda)))
    return model.size.parameters * per_weight


def break_even_rate(spec: SpeculativePairSpec) -> float:
    """The acceptance rate below which drafting certainly costs more than it saves."""
    cuda = spec.resources.gpus > 0
    ratio = _read_bytes(spec.draft, cuda=cuda) / _read_bytes(spec.target, cuda=cuda)
    return min(1.0, ratio)


@dataclass(frozen=True)
class Inputs:
    """What the verdict reads: the knobs in force, the interval, the thresholds."""

    knobs: Mapping[str, Any]  # the speculation section as the pods get it (camelCase)
    acceptance: Mapping[str, Any] | None  # status.acceptance
    current_revision: str | None  # the revision that serves
    min_drafted_tokens: int
    break_even: float


def _pods(entries: Sequence[Mapping[str, Any]]) -> str:
    return ", ".join(str(e.get("pod")) for e in entries)


def _bound(inputs: Inputs) -> tuple[float, str]:
    """The higher of the acceptance floor knob and the break-even rate, and what it is."""
    floor = float(inputs.knobs.get("acceptanceFloor") or 0.0)
    if floor > inputs.break_even:
        return floor, f"speculation.acceptanceFloor {floor:.3f}"
    return inputs.break_even, (
        f"the break-even rate {inputs.break_even:.3f} (draft/target weight bytes: each "
        "drafted token costs at least that share of a target forward)"
    )


def _measured(inputs: Inputs, acceptance: Mapping[str, Any]) -> ConditionUpdate:
    rate, drafted = float(acceptance.get("rate", 0.0)), int(acceptance.get("draftedTokens", 0))
    share = acceptance.get("speculatedShare")
    bound, what = _bound(inputs)
    over = f"over {drafted} drafted tokens of revision {inputs.current_revision}"
    if rate < bound:
        return ConditionUpdate(
            SPECULATION_EFFECTIVE,
            "False",
            "LowAcceptance",
            f"acceptance {rate:.3f} {over} is below {what}: the drafts cost more than they "
            "save. The pair still serves the target's output, at about target-only speed or "
            "slower; use a draft that agrees more with the target, a smaller "
            "speculation.maxDepth, or speculation.enabled: false",
        )
    used = "" if share is None else f"; {float(share):.0%} of the generated tokens from speculation"
    if share is not None and float(share) < MOSTLY_TARGET_ONLY_SHARE:
        generated = int(acceptance.get("generatedTokens") or 0)
        return ConditionUpdate(
            SPECULATION_EFFECTIVE,
            "False",
            "MostlyTargetOnly",
            f"only {float(share):.0%} of the {generated} tokens generated in the interval came "
            "from speculating steps: the runtime decoded the rest target-only (its cost model "
            "found the draft not paying, a batch-size or memory pause, or steps that read "
            f"prompts); acceptance when it drafted {rate:.3f} {over}",
        )
    return ConditionUpdate(
        SPECULATION_EFFECTIVE,
        "True",
        "Effective",
        f"acceptance {rate:.3f} {over}, above {what}{used}",
    )


def verdict(inputs: Inputs) -> ConditionUpdate:
    """The SpeculationEffective condition (see the module docstring)."""
    if not inputs.knobs.get("enabled", True):
        return ConditionUpdate(
            SPECULATION_EFFECTIVE,
            "False",
            "SpeculationOff",
            "speculation is off in the knobs in force (spec.speculation.enabled, or a "
            "TargetOnly placement): the pair serves target-only",
        )
    acceptance = inputs.acceptance or {}
    if inputs.current_revision is None or acceptance.get("revision") != inputs.current_revision:
        return ConditionUpdate(
            SPECULATION_EFFECTIVE,
            "Unknown",
            "NotMeasured",
            "no acceptance measured yet for the revision that serves",
        )
    fell_back = [
        e for e in acceptance.get("speculationOff") or [] if e.get("reason") == "acceptance_floor"
    ]
    if fell_back:
        floor = float(inputs.knobs.get("acceptanceFloor") or 0.0)
        return ConditionUpdate(
            SPECULATION_EFFECTIVE,
            "False",
            "RuntimeFellBack",
            f"the runtime turned speculation off on {_pods(fell_back)}: its rolling acceptance "
            f"fell below speculation.acceptanceFloor {floor:.3f}. The pods serve the target's "
            "output target-only until the knobs change or they restart",
        )
    drafted = int(acceptance.get("draftedTokens", 0))
    if drafted < inputs.min_drafted_tokens:
        return ConditionUpdate(
            SPECULATION_EFFECTIVE,
            "Unknown",
            "NotMeasured",
            f"{drafted} of the {inputs.min_drafted_tokens} drafted tokens "
            "(acceptanceDrift.minDraftedTokens) an interval needs",
        )
    return _measured(inputs, acceptance)
