"""Spec in, child objects out: what the reconcile loop applies, and what ``render`` prints.

`children` is the one place that turns a pair into its children, for either
engine; the reconcile loop applies its result (the workload last: its pods
mount the ConfigMap), and ``specpair-operator render -f pair.yaml`` prints
it offline, so a GitOps pipeline previews exactly what the operator writes.
`render` adds the plan and the revision, as one reconcile pass computes them
from the spec and the device.
"""

from __future__ import annotations

from dataclasses import dataclass

from specpair_operator import builders
from specpair_operator.api import SpeculativePairSpec
from specpair_operator.builders import Manifest, PairRef
from specpair_operator.engines import lws
from specpair_operator.engines import vllm as vllm_engine
from specpair_operator.engines.vllm_args import layout
from specpair_operator.headroom import DeviceMemory, plan_for_spec
from specpair_operator.revision import compute_revision
from specpair_runtime.planner import Plan


def engine_speculates(spec: SpeculativePairSpec, draft_loaded: bool) -> bool:
    """Whether the pods load the draft: the plan has room, and (vLLM) speculation is on.

    The specpair runtime loads the draft even with speculation off, since it
    takes the knob live; vLLM reads its speculative config only at start.
    """
    if spec.engine == "vllm":
        return draft_loaded and spec.speculation.enabled
    return draft_loaded


def children(
    pair: PairRef,
    spec: SpeculativePairSpec,
    revision: str,
    *,
    speculate: bool,
    plan: Plan | None = None,
    per_node: int | None = None,
) -> tuple[Manifest, ...]:
    """ConfigMap, Service and the workload (Deployment or LeaderWorkerSet), in apply order."""
    if spec.engine != "vllm":
        return (
            builders.config_map(pair, spec, revision, speculate=speculate),
            builders.service(pair, spec),
            builders.deployment(pair, spec, revision),
        )
    loads = engine_speculates(spec, speculate)
    shape = layout(spec, plan, per_node)
    workload = (
        lws.leader_worker_set(pair, spec, revision, shape, speculate=loads)
        if shape.multi_node
        else vllm_engine.deployment(pair, spec, revision, shape, speculate=loads)
    )
    group = workload["spec"]["leaderWorkerTemplate"] if shape.multi_node else None
    return (
        vllm_engine.config_map(pair, spec, revision, speculate=loads, group_template=group),
        vllm_engine.service(pair, spec, shape),
        workload,
    )


@dataclass(frozen=True)
class Rendered:
    """One pass's decision for a spec: the plan, the revision and the children."""

    plan: Plan | None
    revision: str
    speculate: bool
    children: tuple[Manifest, ...]  # empty where the pair does not fit

    @property
    def refused(self) -> bool:
        return self.plan is not None and self.plan.mode == "DoesNotFit"


def render(
    pair: PairRef,
    spec: SpeculativePairSpec,
    device: DeviceMemory | None,
    *,
    per_node: int | None = None,
) -> Rendered:
    """The plan on ``device`` (None: unknown), the revision, and the children to apply."""
    plan = None if device is None else plan_for_spec(spec, device, per_node=per_node)
    speculate = plan is None or plan.mode == "Colocated"
    revision = compute_revision(spec, draft_loaded=speculate)
    if plan is not None and plan.mode == "DoesNotFit":
        return Rendered(plan, revision, speculate, ())
    made = children(pair, spec, revision, speculate=speculate, plan=plan, per_node=per_node)
    return Rendered(plan, revision, speculate, made)
