"""Rollback of a failed revision: finding the good template and restoring it."""

from __future__ import annotations

from typing import Any

from specpair_operator.builders import HASH_ANNOTATION, REVISION_LABEL
from specpair_operator.rollback import (
    good_template,
    rolled_back_deployment,
    rollout_failed,
    template_revision,
)


def template(revision: str, image: str) -> dict[str, Any]:
    return {
        "metadata": {"labels": {REVISION_LABEL: revision, "pod-template-hash": "abc"}},
        "spec": {"containers": [{"name": "runtime", "image": image}]},
    }


def replica_set(revision: str, image: str, deployment_revision: int) -> dict[str, Any]:
    return {
        "metadata": {
            "annotations": {"deployment.kubernetes.io/revision": str(deployment_revision)}
        },
        "spec": {"template": template(revision, image)},
    }


def deployment(revision: str, reason: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "labels": {REVISION_LABEL: revision},
                     "annotations": {HASH_ANNOTATION: "h"}, "resourceVersion": "7"},
        "spec": {"replicas": 1, "template": template(revision, "new")},
        "status": {"conditions": [{"type": "Progressing", "status": "False", "reason": reason}]},
    }  # fmt: skip


def test_rollout_failed_only_for_the_running_revision_past_its_deadline() -> None:
    assert rollout_failed(deployment("r2", "ProgressDeadlineExceeded"), "r2")
    assert not rollout_failed(deployment("r2", "ProgressDeadlineExceeded"), "r3")
    assert not rollout_failed(deployment("r2", "ReplicaSetUpdated"), "r2")


def test_good_template_is_the_newest_replica_set_of_that_revision() -> None:
    sets = [
        replica_set("r1", "old-a", 1),
        replica_set("r2", "bad", 3),
        replica_set("r1", "old-b", 2),  # r1 again after an earlier rollback
    ]
    found = good_template(sets, "r1")
    assert found is not None
    assert found["spec"]["containers"][0]["image"] == "old-b"
    # The controller's own label does not go back into the Deployment.
    assert found["metadata"]["labels"] == {REVISION_LABEL: "r1"}
    assert good_template(sets, "r9") is None


def test_rolled_back_deployment_keeps_identity_and_marks_the_hash() -> None:
    dep = deployment("r2", "ProgressDeadlineExceeded")
    good = good_template([replica_set("r1", "old", 1)], "r1")
    assert good is not None
    body = rolled_back_deployment(dep, good, "r1")
    assert template_revision(body) == "r1"
    assert body["metadata"]["labels"][REVISION_LABEL] == "r1"
    assert body["metadata"]["resourceVersion"] == "7"  # a PUT against what was read
    assert body["metadata"]["annotations"][HASH_ANNOTATION] == "rollback-r1"
    assert "status" not in body
    assert dep["spec"]["template"]["metadata"]["labels"][REVISION_LABEL] == "r2"  # not mutated
