"""The engines a pair can run on: small adapters under the operator's pair semantics.

Each engine says how to render its pods (`render.children`), where its pods
answer (the container serving ``/readyz`` with the runtime's body, and the
one serving ``/metrics``), how to read acceptance from its metrics
(`acceptance.py`), and which knobs it takes live (`revision.py`: a knob an
engine cannot take live is in the revision hash). The pair semantics above
them are shared: plan, alignment and golden gate, one versioned rollout with
rollback, acceptance and drift.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ENGINE_LABEL = "specpair.dev/engine"  # on vLLM pods only: specpair pods stay as they are

# engine -> (container serving /readyz, container serving /metrics)
CONTAINERS: Mapping[str, tuple[str, str]] = {
    "specpair": ("runtime", "runtime"),
    "vllm": ("gate", "vllm"),
}


def pod_engine(pod: Mapping[str, Any]) -> str:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return str(labels.get(ENGINE_LABEL) or "specpair")


def readiness_container(pod: Mapping[str, Any]) -> str:
    return CONTAINERS.get(pod_engine(pod), CONTAINERS["specpair"])[0]


def metrics_container(pod: Mapping[str, Any]) -> str:
    return CONTAINERS.get(pod_engine(pod), CONTAINERS["specpair"])[1]
