"""Rollback of a failed revision: finding the good template and restoring it."""

from __future__ import annotations

from typing import Any

from specpair_operator.builders import HASH_ANNOTATION, REVISION_LABEL
from specpair_operator.reconcile import stale_config_maps
from specpair_operator.rollback import (
    failed_check,
    good_template,
    rolled_back_deployment,
    rollout_failed,
    template_revision,
    termination_message,
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


def _pod(name: str, statuses: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"containerStatuses": statuses or []}}


def test_a_failed_readiness_body_is_a_hard_failure_naming_the_check() -> None:
    body = {"ready": False, "phase": "failed", "reason": "golden prompt 'hi' differs"}
    assert failed_check(_pod("p1"), body) == (
        True,
        "pod p1 /readyz failed: golden prompt 'hi' differs",
    )


def test_a_loading_pod_only_explains_a_missed_deadline() -> None:
    body = {"ready": False, "phase": "loading", "reason": "loading the models"}
    assert failed_check(_pod("p1"), body) == (False, "pod p1 /readyz loading: loading the models")
    assert failed_check(_pod("p1"), {"ready": True, "phase": "ready", "reason": ""}) == (
        False,
        None,
    )
    assert failed_check(_pod("p1"), None) == (False, None)


def test_a_termination_message_wins() -> None:
    terminated = {"lastState": {"terminated": {"exitCode": 1, "message": "OOM while loading\n"}}}
    pod = _pod("p2", [{"name": "runtime", **terminated}])
    assert termination_message(pod) == "OOM while loading"
    assert failed_check(pod, None) == (True, "pod p2 terminated: OOM while loading")


def test_stale_config_maps_are_the_owned_ones_outside_the_kept_revisions() -> None:
    def cm(name: str, revision: str | None, uid: str = "u1") -> dict[str, Any]:
        labels = {} if revision is None else {"specpair.dev/revision": revision}
        refs = [{"uid": uid}]
        return {"metadata": {"name": name, "labels": labels, "ownerReferences": refs}}

    found = [cm("a-r1", "r1"), cm("a-r2", "r2"), cm("a-r3", "r3"), cm("x", "r4", uid="other")]
    found.append(cm("plain", None))
    assert stale_config_maps(found, {"r1", "r3"}, "u1") == ["a-r2"]
