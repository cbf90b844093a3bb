"""Issue 11, items 2 and 3: a quiet cluster costs (almost) no API requests, and no status writes.

The requests are counted by the apiserver itself (``apiserver_request_total``
on its ``/metrics``), over a window of several resync periods, after the
pairs and the controllers have settled. The same window without the
operator, just before, is the baseline: the apiserver and the
controller-manager make a few requests of their own (the ``kubernetes``
Service, the garbage collector's relists), and those are not the operator's.
The goal: at most one request per pair per resync period, and zero status
writes, also for pairs whose optional knobs are unset (the desired status
holds ``null`` where the stored one has no key).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from tools.apiserver_metrics import delta
from tools.control_plane import ControlPlane

from tests.support.k8s_fixtures import Kubectl
from tests.support.operator_process import (
    Operator,
    apiserver_requests,
    crd_namespace,
    create_pair,
    items,
    pair_manifest,
    settled,
)
from tests.support.polling import wait_for

pytestmark = pytest.mark.integration

RESYNC_SECONDS = 4.0
WINDOW_SECONDS = 20.0
PAIRS = 4
# What the operator reads or writes; other components' own traffic is not counted.
OPERATOR_RESOURCES = {
    "speculativepairs",
    "deployments",
    "replicasets",
    "pods",
    "configmaps",
    "services",
    "nodes",
    "events",
    "secrets",
}


@pytest.fixture(scope="module")
def namespace(control_plane: ControlPlane, kubectl: Kubectl) -> Iterator[str]:
    with crd_namespace(control_plane, kubectl, "quiet") as name:
        yield name


def terminating_namespaces(plane: ControlPlane) -> list[dict[str, Any]]:
    # A namespace being deleted makes the controller-manager list and delete in it.
    return [
        ns
        for ns in items(plane, "/api/v1/namespaces")
        if ns.get("status", {}).get("phase") == "Terminating"
    ]


def wait_for_no_namespace_terminating(plane: ControlPlane) -> None:
    try:
        wait_for(lambda: not terminating_namespaces(plane), "other tests' namespaces", 120.0)
    except AssertionError as error:
        still = {
            ns["metadata"]["name"]: [
                c.get("message") for c in ns["status"].get("conditions") or [] if c.get("message")
            ]
            for ns in terminating_namespaces(plane)
        }
        raise AssertionError(f"{error}; still terminating: {still}") from None


def versions(plane: ControlPlane, ns: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for path in (
        f"/apis/specpair.dev/v1alpha1/namespaces/{ns}/speculativepairs",
        f"/apis/apps/v1/namespaces/{ns}/deployments",
        f"/api/v1/namespaces/{ns}/configmaps",
        f"/api/v1/namespaces/{ns}/services",
    ):
        for obj in items(plane, path):
            meta = obj["metadata"]
            found[f"{path.rsplit('/', 1)[-1]}/{meta['name']}"] = meta["resourceVersion"]
    return found


def test_a_quiet_minute_costs_no_status_write_and_at_most_one_request_per_pair_and_resync(
    control_plane: ControlPlane, namespace: str, tmp_path: Any
) -> None:
    ns = namespace
    for index in range(PAIRS):
        body = pair_manifest(f"quiet-{index}", resources={"gpus": 1, "gpuMemory": "80Gi"})
        # Unset optional knobs: null in the desired status, absent in the stored one.
        body["spec"]["speculation"].pop("disableAboveBatchSize", None)
        create_pair(control_plane, ns, body)
    operator = Operator(
        control_plane.kubeconfig_path,
        tmp_path / "operator.log",
        [ns],
        resync_seconds=RESYNC_SECONDS,
    )
    wait_for_no_namespace_terminating(control_plane)
    start = apiserver_requests(control_plane)
    time.sleep(WINDOW_SECONDS)
    baseline = delta(apiserver_requests(control_plane), start)
    try:
        operator.start()
        for index in range(PAIRS):
            pair = wait_for(lambda i=index: settled(control_plane, ns, f"quiet-{i}"), "a status")  # type: ignore[misc]
            assert "disableAboveBatchSize" not in pair["status"]["speculation"]

        def deployments_settled() -> bool:
            deps = items(control_plane, f"/apis/apps/v1/namespaces/{ns}/deployments")
            return len(deps) == PAIRS and all(
                d["status"].get("observedGeneration") == d["metadata"]["generation"]
                and d["status"].get("replicas") == d["spec"]["replicas"]
                for d in deps
            )

        wait_for(deployments_settled, "the Deployment controller to settle")
        time.sleep(RESYNC_SECONDS)  # one more resync: every status has seen its Deployment
        before_versions = versions(control_plane, ns)
        before = apiserver_requests(control_plane)
        time.sleep(WINDOW_SECONDS)
        counts = delta(apiserver_requests(control_plane), before)
        after_versions = versions(control_plane, ns)
    finally:
        operator.stop()

    ours = {
        k: v - baseline.get(k, 0)
        for k, v in counts.items()
        if k[1] in OPERATOR_RESOURCES and v > baseline.get(k, 0)
    }
    report = (
        f"requests in {WINDOW_SECONDS:.0f} s beyond the baseline {dict(baseline)}: {ours}\n"
        f"{operator.output()[-2000:]}"
    )
    assert ours.get(("PATCH", "speculativepairs", "status"), 0) == 0, report
    writes = {k: v for k, v in ours.items() if k[0] not in ("GET", "LIST", "WATCH")}
    assert writes == {}, report
    resyncs = WINDOW_SECONDS / RESYNC_SECONDS
    assert sum(ours.values()) <= PAIRS * resyncs, report
    assert after_versions == before_versions  # nothing was written
