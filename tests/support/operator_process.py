"""The operator as a real process, and the helpers its Kubernetes-facing tests share.

`Operator` runs ``python -m specpair_operator run`` as a child process (as in
a pod) against a `ControlPlane`, and is always stopped. The rest reads pairs
and their conditions, builds pairs from the GPU sample, and installs the CRD
as a user does (``kubectl apply -f crds/``).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import yaml
from tools.apiserver_metrics import RequestKey, request_counts
from tools.control_plane import ControlPlane, free_port

from tests.support.k8s_fixtures import Kubectl
from tests.support.polling import PAIRS, get_or_none, wait_for

ROOT = Path(__file__).resolve().parents[2]
SAMPLE: dict[str, Any] = yaml.safe_load((ROOT / "crds" / "samples" / "gpu-pair.yaml").read_text())
# The Secrets the GPU sample names (serving.apiKeySecret, hfTokenSecret): name -> key.
SAMPLE_SECRETS = {"llama-api-key": "api-key", "hf-token": "token"}


def api(plane: ControlPlane, method: str, path: str, body: object = None) -> dict[str, Any]:
    return cast(dict[str, Any], plane.api(method, path, body))


def items(plane: ControlPlane, path: str) -> list[dict[str, Any]]:
    found = api(plane, "GET", path).get("items")
    return list(found) if isinstance(found, list) else []


def condition(pair: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for cond in ((pair or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == type_:
            return dict(cond)
    return None


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text: str = reply.read().decode()
        return text


class Operator:
    """`python -m specpair_operator run` as a child process; always stopped."""

    def __init__(
        self,
        kubeconfig: Path,
        log: Path,
        namespaces: list[str],
        extra: Sequence[str] = (),
        resync_seconds: float = 1.0,
    ) -> None:
        self.kubeconfig, self.log, self.namespaces = kubeconfig, log, namespaces
        self.extra = list(extra)
        self.resync_seconds = resync_seconds
        self.process: subprocess.Popen[bytes] | None = None
        self.metrics_port = free_port()

    def start(self) -> Operator:
        args = [sys.executable, "-m", "specpair_operator", "run"]
        args += ["--resync-seconds", str(self.resync_seconds)]
        args += ["--metrics-port", str(self.metrics_port), "--metrics-address", "127.0.0.1"]
        for ns in self.namespaces:
            args += ["--namespace", ns]
        args += self.extra
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(sig)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@contextlib.contextmanager
def running_operator(
    kubeconfig: Path, tmp_path: Path, namespaces: list[str], **options: Any
) -> Iterator[Operator]:
    log = tmp_path / f"operator-{uuid.uuid4().hex[:6]}.log"
    operator = Operator(kubeconfig, log, namespaces, **options)
    try:
        yield operator.start()
    finally:
        operator.stop()


@contextlib.contextmanager
def crd_namespace(plane: ControlPlane, kubectl: Kubectl, prefix: str) -> Iterator[str]:
    """The CRDs installed and a fresh namespace for one test module, deleted afterwards."""
    install_crds(kubectl)
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    plane.ensure_namespace(name)
    try:
        yield name
    finally:
        if plane.running():
            with contextlib.suppress(OSError):
                plane.api("DELETE", f"/api/v1/namespaces/{name}")


def pair_manifest(name: str, **spec_changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(json.dumps(SAMPLE))
    body["metadata"] = {"name": name}
    body["spec"].update(spec_changes)
    return body


def create_sample_secrets(plane: ControlPlane, ns: str) -> None:
    """The Secrets the GPU sample names, so that its pods could start."""
    for name, key in SAMPLE_SECRETS.items():
        secret = {"metadata": {"name": name}, "data": {key: base64.b64encode(b"x").decode()}}
        with contextlib.suppress(urllib.error.HTTPError):  # 409: there already
            api(plane, "POST", f"/api/v1/namespaces/{ns}/secrets", secret)


def create_pair(plane: ControlPlane, ns: str, body: dict[str, Any]) -> dict[str, Any]:
    """Create the pair, and first the sample's Secrets it may name."""
    create_sample_secrets(plane, ns)
    return api(plane, "POST", PAIRS.format(ns=ns), body)


def pair_path(ns: str, name: str) -> str:
    return PAIRS.format(ns=ns) + f"/{name}"


def settled(plane: ControlPlane, ns: str, name: str) -> dict[str, Any] | None:
    """The pair once its status describes its current generation."""
    pair = get_or_none(plane, pair_path(ns, name))
    if pair is None:
        return None
    status = pair.get("status") or {}
    if status.get("observedGeneration") != pair["metadata"]["generation"]:
        return None
    return pair if condition(pair, "HeadroomSufficient") else None


def apply_crds(kubectl: Kubectl) -> None:
    # The documented command for apiservers older than 1.25: kubectl checks a
    # manifest against the *server's* OpenAPI when the server cannot validate
    # fields itself, and v1.20's JSONSchemaProps predates x-kubernetes-validations,
    # so kubectl would refuse the CEL rules that the apiserver itself accepts (and
    # drops). --validate=false is what every kubectl version takes (kubectl < 1.25
    # has no --validate=warn).
    kubectl("apply", "--validate=false", "-f", str(ROOT / "crds"))


def install_crds(kubectl: Kubectl) -> None:
    """`kubectl apply -f crds/`, as a user installs it; waits until Established."""
    apply_crds(kubectl)
    wait_crd_established(kubectl)


def wait_crd_established(kubectl: Kubectl) -> None:
    """Wait until the SpeculativePair CRD is Established (however it was installed)."""

    # kubectl wait fails at once ("conditions accessor error") on a CRD so new
    # that the apiserver has not written its status yet: ask again.
    def established() -> bool:
        waited = kubectl(
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/speculativepairs.specpair.dev",
            check=False,
        )
        return waited.returncode == 0

    wait_for(established, "the CRD Established", timeout=90)


def kubectl_patch(kubectl: Kubectl, ns: str, name: str, patch: dict[str, Any]) -> None:
    kubectl("patch", "spair", "-n", ns, name, "--type=merge", "-p", json.dumps(patch))


def play_kubelet_ready(kubectl: Kubectl, ns: str, selector: str, limit: int | None = None) -> int:
    """Write the selected pods' status Running and Ready, as a kubelet would. Returns how many.

    For operator tests that need a Pod's status, not a running pod (GPU pairs
    on labelled Node objects); pods that run are in tests/e2e/test_node_e2e.py.
    """
    pods = json.loads(kubectl("get", "pods", "-n", ns, "-l", selector, "-o", "json").stdout)
    now = _now()
    ready = [
        {"type": kind, "status": "True", "lastTransitionTime": now}
        for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
    ]
    chosen = sorted(pods["items"], key=lambda p: p["metadata"]["name"])[:limit]
    for pod in chosen:
        status = {"status": {"phase": "Running", "conditions": ready, "startTime": now}}
        kubectl(
            "patch", "pod", "-n", ns, pod["metadata"]["name"], "--subresource=status",
            "--type=merge", "-p", json.dumps(status),
        )  # fmt: skip
    return len(chosen)


def gpu_node(name: str, mib: int, pool: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"nvidia.com/gpu.memory": str(mib), "pool": pool}},
    }


def set_node_ready(plane: ControlPlane, name: str, ready: bool = True) -> None:
    """Play the kubelet's heartbeat once: the node's Ready condition, fresh."""
    now = _now()
    status = {
        "status": {
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True" if ready else "False",
                    "reason": "KubeletReady" if ready else "KubeletNotReady",
                    "message": "played by the test",
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }
            ]
        }
    }
    request_body = json.dumps(status).encode()
    request = urllib.request.Request(
        f"{plane.server_url}/api/v1/nodes/{name}/status",
        data=request_body,
        method="PATCH",
        headers={
            "Authorization": f"Bearer {plane.admin_token}",
            "Content-Type": "application/merge-patch+json",
        },
    )
    context = ssl.create_default_context(cafile=str(plane.ca_path))
    with urllib.request.urlopen(request, context=context, timeout=30):
        pass


def create_ready_node(plane: ControlPlane, node: dict[str, Any]) -> None:
    """A Node object, reported Ready (the node controller marks it Unknown after 40 s)."""
    api(plane, "POST", "/api/v1/nodes", node)
    set_node_ready(plane, node["metadata"]["name"])


class NodeHeartbeats:
    """Plays the kubelets of test nodes: a fresh Ready condition every few seconds.

    Without it the node controller marks a node Unknown 40 s after its last
    heartbeat, which would change what the operator counts mid-test.
    """

    def __init__(self, plane: ControlPlane, interval: float = 10.0) -> None:
        self.plane, self.interval = plane, interval
        self.ready: dict[str, bool] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._lock = threading.Lock()

    def __enter__(self) -> NodeHeartbeats:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for name in list(self.ready):
            self.delete(name)

    def add(self, node: dict[str, Any], ready: bool = True) -> None:
        name = node["metadata"]["name"]
        api(self.plane, "POST", "/api/v1/nodes", node)
        set_node_ready(self.plane, name, ready)
        with self._lock:
            self.ready[name] = ready

    def delete(self, name: str) -> None:
        with self._lock:
            self.ready.pop(name, None)
        with contextlib.suppress(urllib.error.HTTPError):
            api(self.plane, "DELETE", f"/api/v1/nodes/{name}")

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                nodes = dict(self.ready)
            for name, ready in nodes.items():
                with contextlib.suppress(urllib.error.HTTPError, OSError):
                    set_node_ready(self.plane, name, ready)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def apiserver_requests(plane: ControlPlane) -> Counter[RequestKey]:
    """``apiserver_request_total`` of ``plane`` by (verb, resource, subresource)."""
    return request_counts(plane.server_url, plane.admin_token, plane.ca_path)
