"""A pair larger than one node: the LeaderWorkerSet the operator renders, on a real apiserver.

The LeaderWorkerSet CRD (leaderworkerset.x-k8s.io/v1, `tools/lws_crd.py`) is
installed on the v1.20 test apiserver, whose structural-schema validation
then checks every field of the rendered object. There is no LWS controller
here (nor a GPU): the test plays its status, as the fake kubelet plays pods.

- ``render -f`` piped into ``kubectl create --dry-run=server``: the GitOps
  preview is accepted as it stands, and a wrong field is refused;
- the operator creates the ConfigMap, the Service and the LeaderWorkerSet
  (no Deployment), plans per GPU, and reads the group's status: Ready once
  the LeaderWorkerSet reports its group ready.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from tools.control_plane import ControlPlane
from tools.lws_crd import render_crd

from tests.support.k8s_fixtures import Kubectl, KubectlError
from tests.support.operator_process import (
    api,
    condition,
    create_pair,
    install_crds,
    pair_path,
    running_operator,
)
from tests.support.polling import get_or_none, wait_for

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "crds" / "samples" / "vllm-405b-pair.yaml"
LWS_CRD = "leaderworkersets.leaderworkerset.x-k8s.io"


@pytest.fixture(scope="module")
def lws_crd(control_plane: ControlPlane, kubectl: Kubectl) -> Iterator[None]:
    install_crds(kubectl)
    kubectl("create", "-f", "-", input=render_crd())
    try:
        wait_for(
            lambda: kubectl(
                "wait", "--for=condition=Established", "--timeout=60s", f"crd/{LWS_CRD}",
                check=False,
            ).returncode == 0,
            "the LeaderWorkerSet CRD Established",
            timeout=90,
        )  # fmt: skip
        yield
    finally:
        kubectl("delete", "crd", LWS_CRD, "--wait=false", check=False)


def rendered(namespace: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-m", "specpair_operator", "render", "-f", str(SAMPLE),
         "--namespace", namespace],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def json_objects(text: str) -> list[dict[str, Any]]:
    """kubectl's ``-o json`` of several objects: one JSON document after another."""
    decoder, found, index = json.JSONDecoder(), [], 0
    while index < len(text.rstrip()):
        obj, index = decoder.raw_decode(text, index)
        found.append(obj)
        while index < len(text) and text[index].isspace():
            index += 1
    return found


def test_the_rendered_leader_worker_set_passes_the_apiservers_schema(
    control_plane: ControlPlane, kubectl: Kubectl, lws_crd: None, k8s_namespace: str
) -> None:
    docs = rendered(k8s_namespace)
    assert [d["kind"] for d in docs] == ["ConfigMap", "Service", "LeaderWorkerSet"]
    text = yaml.safe_dump_all(docs)
    done = kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", input=text)
    created = json_objects(done.stdout)
    assert [item["kind"] for item in created] == ["ConfigMap", "Service", "LeaderWorkerSet"]
    group = created[2]
    # The server filled the CRD's defaults in: the schema really applied.
    assert group["spec"]["startupPolicy"] == "LeaderCreated"
    assert group["spec"]["leaderWorkerTemplate"]["size"] == 2
    # And it refuses what the schema does not allow.
    wrong = copy.deepcopy(docs[2])
    wrong["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Sometimes"
    wrong["spec"]["leaderWorkerTemplate"]["size"] = "two"
    with pytest.raises(KubectlError) as refused:
        kubectl("create", "--dry-run=server", "-f", "-", input=yaml.safe_dump(wrong))
    message = str(refused.value)
    assert "spec.leaderWorkerTemplate.restartPolicy" in message
    assert "spec.leaderWorkerTemplate.size" in message


def test_the_operator_runs_a_pair_past_one_node_as_a_leader_worker_set(
    control_plane: ControlPlane, lws_crd: None, k8s_namespace: str, tmp_path: Path
) -> None:
    ns = k8s_namespace
    body = yaml.safe_load(SAMPLE.read_text())
    body["metadata"] = {"name": "big"}
    groups = f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{ns}/leaderworkersets"
    with running_operator(control_plane.kubeconfig_path, tmp_path, [ns]) as operator:
        create_pair(control_plane, ns, body)
        group = wait_for(lambda: get_or_none(control_plane, f"{groups}/big"), "the group")
        pair = wait_for(
            lambda: (
                (p := get_or_none(control_plane, pair_path(ns, "big")))
                and (p.get("status") or {}).get("placement")
                and p
            ),
            "the plan in the status",
        )
        placement = pair["status"]["placement"]
        assert placement["mode"] == "Colocated" and "over 2 nodes of 8 GPUs" in placement["reason"]
        assert (placement["tensorParallelSize"], placement["nodes"]) == (16, 2)
        assert placement["gpuMemoryUtilization"] == 0.9
        assert get_or_none(control_plane, f"/apis/apps/v1/namespaces/{ns}/deployments/big") is None
        assert (condition(pair, "Ready") or {}).get("status") == "False"
        # Play the LeaderWorkerSet controller: the group is up.
        status = {
            "replicas": 1,
            "readyReplicas": 1,
            "updatedReplicas": 1,
            "observedGeneration": group["metadata"]["generation"],
        }
        api(control_plane, "PUT", f"{groups}/big/status", {**group, "status": status})
        ready = wait_for(
            lambda: (
                (c := condition(get_or_none(control_plane, pair_path(ns, "big")), "Ready"))
                and c["status"] == "True"
                and c
            ),
            "Ready from the group's status",
        )
        assert ready["reason"] == "Serving"
        revision = group["metadata"]["labels"]["specpair.dev/revision"]
        served = api(control_plane, "GET", pair_path(ns, "big"))
        assert served["status"]["currentRevision"] == revision
        roll_back_a_failing_group(control_plane, ns, groups, revision)
    assert "Traceback" not in operator.output(), operator.output()[-3000:]


def leader_template_revision(group: dict[str, Any]) -> str:
    template = group["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    return str(template["metadata"]["labels"]["specpair.dev/revision"])


def roll_back_a_failing_group(plane: ControlPlane, ns: str, groups: str, good: str) -> None:
    """A new version whose leader's gate fails is rolled back to the good group template."""
    pair = api(plane, "GET", pair_path(ns, "big"))
    pair["spec"]["version"] = "2024-10-bad"
    api(plane, "PUT", pair_path(ns, "big"), pair)
    bad = wait_for(
        lambda: (r := leader_template_revision(api(plane, "GET", f"{groups}/big"))) != good and r,
        "the new group template",
    )
    # Play the LWS controller and kubelet: the new group's leader, its gate failed.
    labels = {
        "app.kubernetes.io/instance": "big",
        "app.kubernetes.io/managed-by": "specpair-operator",
        "specpair.dev/revision": bad,
        "specpair.dev/engine": "vllm",
        "leaderworkerset.sigs.k8s.io/worker-index": "0",
    }
    pod = {
        "metadata": {"name": "big-0", "labels": labels},
        "spec": {"containers": [{"name": "gate", "image": "specpair"}]},
    }
    created = api(plane, "POST", f"/api/v1/namespaces/{ns}/pods", pod)
    message = "golden prompts failed: capital: output does not contain 'Paris'"
    terminated = {"exitCode": 1, "reason": "Error", "message": message}
    created["status"] = {
        "phase": "Running",
        "containerStatuses": [
            {
                "name": "gate",
                "image": "specpair",
                "imageID": "",
                "ready": False,
                "restartCount": 1,
                "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                "lastState": {"terminated": {**terminated, "startedAt": None}},
            }
        ],
    }
    created["status"]["containerStatuses"][0]["lastState"]["terminated"].pop("startedAt")
    api(plane, "PUT", f"/api/v1/namespaces/{ns}/pods/big-0/status", created)
    degraded = wait_for(
        lambda: (
            (c := condition(get_or_none(plane, pair_path(ns, "big")), "Degraded"))
            and c["reason"] == "RolloutFailed"
            and c
        ),
        "the rollback",
    )
    assert message in degraded["message"]
    assert leader_template_revision(api(plane, "GET", f"{groups}/big")) == good
    api(plane, "DELETE", f"/api/v1/namespaces/{ns}/pods/big-0?gracePeriodSeconds=0")
