"""Roll a failed revision back to the last good one (pure parts).

A new revision whose pods do not pass ``/readyz`` within
``rollout.progressDeadlineSeconds`` makes the Deployment report
``ProgressDeadlineExceeded``. ``maxUnavailable: 0`` kept the old pods
serving; the operator then puts the last good revision's pod template back
(what ``kubectl rollout undo`` does: it is kept in the old ReplicaSet) and
marks the failed revision on the pair with an annotation, so that the next
pass does not roll it out again. Any spec change that gives a new revision
clears the hold.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

from specpair_operator.builders import HASH_ANNOTATION, REVISION_LABEL

FAILED_REVISION_ANNOTATION = "specpair.dev/failed-revision"
ROLLBACK_HASH_PREFIX = "rollback-"
_DEPLOYMENT_REVISION = "deployment.kubernetes.io/revision"


def template_revision(deployment: Mapping[str, Any]) -> str | None:
    labels = deployment["spec"]["template"]["metadata"].get("labels") or {}
    value = labels.get(REVISION_LABEL)
    return str(value) if value is not None else None


def rollout_failed(deployment: Mapping[str, Any], revision: str) -> bool:
    """The Deployment runs ``revision`` and has given up on it."""
    if template_revision(deployment) != revision:
        return False
    for cond in (deployment.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Progressing":
            return bool(cond.get("reason") == "ProgressDeadlineExceeded")
    return False


def good_template(
    replica_sets: Iterable[Mapping[str, Any]], revision: str
) -> dict[str, Any] | None:
    """The pod template of the newest ReplicaSet of ``revision``, ready for a Deployment."""
    matching = [
        rs
        for rs in replica_sets
        if (rs["spec"]["template"]["metadata"].get("labels") or {}).get(REVISION_LABEL) == revision
    ]
    if not matching:
        return None
    newest = max(
        matching,
        key=lambda rs: int((rs["metadata"].get("annotations") or {}).get(_DEPLOYMENT_REVISION, 0)),
    )
    template = copy.deepcopy(dict(newest["spec"]["template"]))
    # The Deployment controller adds this label to its ReplicaSets, not to the Deployment.
    template["metadata"].get("labels", {}).pop("pod-template-hash", None)
    return template


def rolled_back_deployment(
    deployment: Mapping[str, Any], template: Mapping[str, Any], good: str
) -> dict[str, Any]:
    """The Deployment with the good template back (for a PUT)."""
    body = copy.deepcopy(dict(deployment))
    body.pop("status", None)
    body["spec"]["template"] = copy.deepcopy(dict(template))
    meta = body["metadata"]
    meta.setdefault("labels", {})[REVISION_LABEL] = good
    # Never equal to a builder's hash: the next real revision replaces it.
    meta.setdefault("annotations", {})[HASH_ANNOTATION] = ROLLBACK_HASH_PREFIX + good
    return body


def termination_message(pod: Mapping[str, Any]) -> str | None:
    """The runtime container's termination message (current or last run), if any."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        for key in ("state", "lastState"):
            terminated = (status.get(key) or {}).get("terminated") or {}
            message = terminated.get("message")
            if message:
                return str(message).strip()
    return None


def failed_check(
    pod: Mapping[str, Any], readiness: Mapping[str, Any] | None
) -> tuple[bool, str | None]:
    """(hard failure, what the pod says about why it is not ready).

    A ``/readyz`` body with phase ``failed`` (golden prompts, alignment) or a
    terminated container is a hard failure: the revision is rolled back at
    once. Otherwise the body's reason (e.g. still loading) only explains a
    missed progress deadline.
    """
    name = (pod.get("metadata") or {}).get("name", "?")
    message = termination_message(pod)
    if message:
        return True, f"pod {name} terminated: {message}"
    if readiness is None:
        return False, None
    phase, reason = readiness.get("phase"), readiness.get("reason", "")
    if phase == "failed":
        return True, f"pod {name} /readyz failed: {reason}"
    if phase == "ready":
        return False, None
    return False, f"pod {name} /readyz {phase}: {reason}"
