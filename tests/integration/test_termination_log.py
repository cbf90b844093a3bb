"""Issue 11, item 8: why `serve` died reaches the pod's status, and a crash loop rolls back at once.

1. The real ``specpair-runtime serve`` writes its fatal start-up reason to the
   termination log (``SPECPAIR_TERMINATION_LOG`` points it at a file, as the
   kubelet's bind mount of ``/dev/termination-log`` would), and never fails
   because the file cannot be written.
2. On the real control plane, with the real operator and one real runtime
   process per pod (the fake kubelet plays the node and reads the termination
   message as the kubelet does): a new revision whose pods die at start-up
   (its API-key Secret is empty) is rolled back with the runtime's own
   message, long before ``rollout.progressDeadlineSeconds``.
"""

from __future__ import annotations

import base64
import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from tools.control_plane import ControlPlane

from tests.support.fake_kubelet import FakeKubelet
from tests.support.k8s_fixtures import Kubectl
from tests.support.operator_process import Operator, condition, install_crds, pair_path
from tests.support.polling import PAIRS, get_or_none, wait_for
from tests.support.server_harness import free_port

pytestmark = pytest.mark.integration

DEADLINE_SECONDS = 600  # the rollback must not wait for this


def serve(config: Path, termination_log: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPECPAIR_TERMINATION_LOG": str(termination_log)}
    return subprocess.run(
        [sys.executable, "-m", "specpair_runtime", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def runtime_config(target: Path, draft: Path, **serving: Any) -> dict[str, Any]:
    return {
        "pair": {"name": "t", "version": "v1"},
        "target": {"source": str(target)},
        "draft": {"source": str(draft)},
        "serving": {"host": "127.0.0.1", "port": free_port(), **serving},
    }


def test_serve_writes_why_it_could_not_start(tmp_path: Path, pair: tuple[Path, Path]) -> None:
    empty_key = tmp_path / "api-key"
    empty_key.write_text("")
    config = tmp_path / "runtime.yaml"
    config.write_text(yaml.safe_dump(runtime_config(*pair, apiKeyFile=str(empty_key))))
    log = tmp_path / "termination-log"
    log.write_text("")  # the kubelet provides an empty file
    done = serve(config, log)
    assert done.returncode != 0
    message = log.read_text()
    assert message.startswith("specpair-runtime serve: ConfigError: ")
    assert "serving.apiKeyFile" in message and "empty" in message

    # Outside a pod the file is usually missing: the same exit, no traceback, no file.
    missing = tmp_path / "no-such-dir" / "termination-log"
    again = serve(config, missing)
    assert again.returncode == done.returncode
    assert "Traceback" not in again.stderr and not missing.exists()


# --- on the real control plane ------------------------------------------------------


def pair_body(name: str, version: str, models: tuple[Path, Path], port: int) -> dict[str, Any]:
    size = {"parameters": 200000, "layers": 2, "kvHeads": 2, "headDim": 16}
    target, draft = models
    return {
        "apiVersion": "specpair.dev/v1alpha1",
        "kind": "SpeculativePair",
        "metadata": {"name": name},
        "spec": {
            "version": version,
            "target": {"source": str(target), "dtype": "float32", "size": size},
            "draft": {"source": str(draft), "dtype": "float32", "size": size},
            "speculation": {"adaptive": False, "maxDepth": 2},
            "resources": {"gpus": 0, "cpu": "1", "memory": "2Gi"},
            "replicas": 1,
            "serving": {"port": port, "maxBatchSize": 2, "maxModelLength": 128},
            "rollout": {"progressDeadlineSeconds": DEADLINE_SECONDS},
        },
    }


@pytest.fixture
def cluster(
    control_plane: ControlPlane, kubectl: Kubectl, k8s_namespace: str, tmp_path: Path
) -> Iterator[tuple[FakeKubelet, Operator]]:
    install_crds(kubectl)
    kubelet = FakeKubelet(control_plane, k8s_namespace, tmp_path / "kubelet")
    operator = Operator(control_plane.kubeconfig_path, tmp_path / "operator.log", [k8s_namespace])
    try:
        kubelet.start()
        operator.start()
        yield kubelet, operator
    finally:
        operator.stop()
        with contextlib.suppress(OSError):
            listed = control_plane.api("GET", PAIRS.format(ns=k8s_namespace)).get("items")
            for item in listed if isinstance(listed, list) else []:
                control_plane.api("DELETE", pair_path(k8s_namespace, item["metadata"]["name"]))
        kubelet.stop()


@pytest.mark.slow
def test_a_crash_looping_revision_rolls_back_with_the_runtimes_reason(
    control_plane: ControlPlane,
    cluster: tuple[FakeKubelet, Operator],
    k8s_namespace: str,
    pair: tuple[Path, Path],
) -> None:
    kubelet, operator = cluster
    ns, name = k8s_namespace, f"crash-{uuid.uuid4().hex[:4]}"
    body = pair_body(name, "v1", pair, free_port())
    control_plane.api("POST", PAIRS.format(ns=ns), body)

    def current() -> str | None:
        found = get_or_none(control_plane, pair_path(ns, name)) or {}
        ready = condition(found, "Ready") or {}
        revision = (found.get("status") or {}).get("currentRevision")
        return revision if ready.get("status") == "True" else None

    try:
        good = wait_for(current, "v1 Ready", timeout=180)
        # v2: an API key from a Secret that holds nothing. The pod starts, reads the
        # mounted key and exits: a crash loop on a real node.
        secret = {
            "metadata": {"name": "empty-key"},
            "data": {"key": base64.b64encode(b"").decode()},
        }
        control_plane.api("POST", f"/api/v1/namespaces/{ns}/secrets", secret)
        body["spec"]["version"] = "v2"
        body["spec"]["serving"]["apiKeySecret"] = {"name": "empty-key", "key": "key"}
        found = dict(control_plane.api("GET", pair_path(ns, name)))
        found["spec"] = body["spec"]
        control_plane.api("PUT", pair_path(ns, name), found)

        def rolled_back() -> dict[str, Any] | None:
            degraded = condition(get_or_none(control_plane, pair_path(ns, name)), "Degraded")
            return degraded if degraded and degraded["reason"] == "RolloutFailed" else None

        # Well inside the deadline: the termination message makes it a hard failure.
        degraded = wait_for(rolled_back, "the rollback", timeout=DEADLINE_SECONDS / 4)
    except BaseException:
        print(operator.output()[-6000:], kubelet.logs(), sep="\n")
        raise
    assert (
        "terminated: specpair-runtime serve: ConfigError: serving.apiKeyFile" in degraded["message"]
    ), degraded
    assert "progressDeadlineSeconds" not in degraded["message"]
    status: dict[str, Any] = (get_or_none(control_plane, pair_path(ns, name)) or {})["status"]
    assert (status["currentRevision"], status["servingVersion"]) == (good, "v1")
    selector = f"specpair.dev/revision%3D{good}"
    pods = get_or_none(control_plane, f"/api/v1/namespaces/{ns}/pods?labelSelector={selector}")
    names = [p["metadata"]["name"] for p in (pods or {}).get("items") or []]
    running = [kubelet.pod_by_name(n) for n in names]
    assert any(r is not None and r.process.poll() is None for r in running)  # v1 kept serving
