"""Node inventory and the placement of a serving pair (pure).

GPU memory read from node labels follows the cluster: a node joins, leaves,
turns NotReady or is cordoned. For a pair that is not serving yet, the plan
simply follows. For a serving pair, a plan whose mode would load or drop the
draft (Colocated <-> TargetOnly), or that no longer fits, would roll out a
new revision because of the inventory alone. That is never done silently:
the pair keeps the placement it serves with, an Event and the
``PlacementChangePending`` condition say what the inventory now gives, and
the change goes ahead once confirmed with the annotation
``specpair.dev/confirm-placement: <mode>`` (or always, with ``auto``).
A change of the spec (the user's own intent) is followed at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specpair_operator.api import SpeculativePairSpec
from specpair_operator.headroom import DeviceMemory, plan_for_spec
from specpair_runtime.planner import Plan

CONFIRM_ANNOTATION = "specpair.dev/confirm-placement"
FOLLOW_ALWAYS = "auto"
UNKNOWN = "Unknown"  # no node says how large the device is


def _loads_draft(mode: str) -> bool:
    # Unknown memory deploys with speculation on (the runtime guards memory itself).
    return mode in ("Colocated", UNKNOWN)


@dataclass(frozen=True)
class Placement:
    """The plan in force, and the one the inventory gives when it is held back."""

    device: DeviceMemory | None
    plan: Plan | None
    pending: str | None = None  # the held change, as a message


def decide(
    spec: SpeculativePairSpec,
    device: DeviceMemory | None,
    previous: Mapping[str, Any] | None,
    serving: bool,
    confirm: str | None,
) -> Placement:
    """The placement to use, given the new inventory and the placement served with."""
    plan = None if device is None else plan_for_spec(spec, device)
    follow = Placement(device, plan)
    if not serving or not previous or spec.resources.gpus == 0:
        return follow
    if spec.resources.gpu_memory is not None:
        return follow  # the spec says how large the device is
    old_source = str(previous.get("deviceSource", ""))
    old_mode = str(previous.get("mode", ""))
    if not old_source.startswith("node ") or "deviceBytes" not in previous:
        return follow  # the spec used to say; the user changed it
    new_mode = UNKNOWN if plan is None else plan.mode
    if new_mode == old_mode:
        return follow
    old_device = DeviceMemory(int(previous["deviceBytes"]), old_source, cuda=True)
    old_plan = plan_for_spec(spec, old_device)
    if old_plan.mode != old_mode:
        return follow  # the spec changed the plan on the same device
    same_pods = _loads_draft(new_mode) == _loads_draft(old_mode) and new_mode != "DoesNotFit"
    if same_pods and new_mode != UNKNOWN:
        return follow  # same pods, same revision
    if confirm in (new_mode, FOLLOW_ALWAYS):
        return follow
    if same_pods:
        # The labelled nodes went away: keep the last known plan, nothing to confirm.
        return Placement(old_device, old_plan)
    why = (
        "no Ready, schedulable node that the pair may use carries nvidia.com/gpu.memory"
        if plan is None or device is None
        else f"{device.source}: {plan.reason}"
    )
    message = (
        f"the node inventory now gives placement {new_mode} ({why}); the pair keeps "
        f"serving {old_mode} as planned on {old_source}. To switch, annotate the pair "
        f"{CONFIRM_ANNOTATION}={new_mode} (or {FOLLOW_ALWAYS} to always follow the nodes)"
    )
    return Placement(old_device, old_plan, pending=message)
