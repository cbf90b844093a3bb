"""The user's path onto a cluster: `helm install` with the local images, a pair, its Service.

Shared by the end-to-end test on the real node (tests/e2e/test_node_e2e.py)
and the deployment benchmark (bench/bench_deploy.py). Everything goes
through the cluster's own interfaces: helm and kubectl with a kubeconfig,
the apiserver's REST API, and HTTP to a Service's ClusterIP (kube-proxy
routes it from the host).
"""

from __future__ import annotations

import itertools
import json
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "specpair-operator"
RELEASE = "specpair"
RELEASE_NAMESPACE = "specpair-system"
PAIRS = "/apis/specpair.dev/v1alpha1/namespaces/{ns}/speculativepairs"
T = TypeVar("T")


class DeployError(RuntimeError):
    """A step of the deployment failed; the message says which and why."""


def wait_until(
    probe: Callable[[], T | None],
    what: str,
    timeout: float = 60.0,
    interval: float = 0.2,
    error: type[Exception] = DeployError,
) -> T:
    """Poll ``probe`` until it returns something truthy; raise ``error`` naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise error(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


@dataclass(frozen=True)
class Tool:
    """kubectl or helm with a fixed kubeconfig."""

    binary: Path
    kubeconfig: Path
    timeout_s: float = 300.0

    def __call__(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        argv = [str(self.binary), "--kubeconfig", str(self.kubeconfig), *args]
        done = subprocess.run(
            argv, input=input, capture_output=True, text=True, check=False, timeout=self.timeout_s
        )
        if check and done.returncode != 0:
            raise DeployError(
                f"`{self.binary.name} {' '.join(args)}` exited {done.returncode}:\n"
                f"{done.stdout[-2000:]}{done.stderr[-4000:]}"
            )
        return done


def image_values(operator_image: str) -> list[str]:
    """`--set` arguments that point the chart at a local operator image."""
    repository, _, tag = operator_image.rpartition(":")
    if not repository:
        raise DeployError(f"the operator image {operator_image!r} needs a tag")
    return ["--set", f"image.repository={repository}", "--set", f"image.tag={tag}"]


def helm_install(
    helm: Tool, operator_image: str, values: dict[str, str] | None = None, timeout: str = "5m"
) -> None:
    """`helm install --wait` of the chart, its operator image the local one.

    v1.20's server-side apply cannot take the CRD's CEL rules, so the install
    is client-side (charts/specpair-operator/README.md).
    """
    sets = [arg for key, value in (values or {}).items() for arg in ("--set", f"{key}={value}")]
    helm(
        "install",
        RELEASE,
        str(CHART),
        "--namespace",
        RELEASE_NAMESPACE,
        "--create-namespace",
        "--server-side=false",
        "--wait",
        "--timeout",
        timeout,
        *image_values(operator_image),
        *sets,
    )


def helm_uninstall(helm: Tool) -> None:
    helm("uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE, "--wait", check=False)


class ApiClient(Protocol):
    """What talks to the apiserver: a `ControlPlane`, or a `KubeconfigClient`."""

    def api(self, method: str, path: str, body: object | None = None) -> dict[str, object]: ...


@dataclass(frozen=True)
class KubeconfigClient:
    """JSON requests to the apiserver as the user of a bearer-token kubeconfig.

    The kubeconfig `start --node` prints; what a user of the node has.
    """

    server: str
    ca: Path
    token: str

    @classmethod
    def load(cls, kubeconfig: Path) -> KubeconfigClient:
        config = yaml.safe_load(kubeconfig.read_text())
        context = next(c for c in config["contexts"] if c["name"] == config["current-context"])
        cluster = next(c for c in config["clusters"] if c["name"] == context["context"]["cluster"])
        user = next(u for u in config["users"] if u["name"] == context["context"]["user"])
        return cls(
            cluster["cluster"]["server"],
            Path(cluster["cluster"]["certificate-authority"]),
            user["user"]["token"],
        )

    def api(self, method: str, path: str, body: object | None = None) -> dict[str, object]:
        request = urllib.request.Request(
            self.server + path,
            data=json.dumps(body).encode() if body is not None else None,
            method=method,
            headers={
                "Authorization": f"Bearer {self.token}",
                "Content-Type": "application/json",
                "Accept": "application/json",
            },
        )
        context = ssl.create_default_context(cafile=str(self.ca))
        with urllib.request.urlopen(request, context=context, timeout=30) as reply:
            return cast(dict[str, object], json.loads(reply.read() or b"{}"))


def api(plane: ApiClient, method: str, path: str, body: object = None) -> dict[str, Any]:
    return cast(dict[str, Any], plane.api(method, path, body))


def get_or_none(plane: ApiClient, path: str) -> dict[str, Any] | None:
    try:
        return api(plane, "GET", path)
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return None
        raise


def condition(body: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for found in ((body or {}).get("status") or {}).get("conditions") or []:
        if found.get("type") == type_:
            return dict(found)
    return {}


def pair_path(namespace: str, name: str) -> str:
    return PAIRS.format(ns=namespace) + f"/{name}"


def service_url(plane: ApiClient, namespace: str, name: str) -> str:
    """``http://<ClusterIP>:<port>`` of the pair's Service."""
    service = api(plane, "GET", f"/api/v1/namespaces/{namespace}/services/{name}")
    spec = service["spec"]
    return f"http://{spec['clusterIP']}:{spec['ports'][0]['port']}"


def post_json(url: str, body: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return cast(dict[str, Any], json.loads(reply.read()))


def complete(base: str, prompt: str, max_tokens: int = 16, timeout: float = 60.0) -> dict[str, Any]:
    """One OpenAI completion, greedy."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    return post_json(f"{base}/v1/completions", body, timeout)


def model_card(base: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as reply:
        return cast(dict[str, Any], json.loads(reply.read())["data"][0])


@dataclass
class SteadyClient:
    """Completions one after another through a URL; counts what succeeded and what failed."""

    base: str
    prompts: Sequence[str]
    max_tokens: int = 16
    pause_s: float = 0.05
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _loop(self) -> None:
        for prompt in itertools.cycle(self.prompts):
            if self._stop.is_set():
                return
            began = time.monotonic()
            try:
                reply = complete(self.base, prompt, self.max_tokens)
                if not reply.get("choices"):
                    raise ValueError(f"a reply without choices: {reply}")
                self.ok += 1
                self.latencies.append(time.monotonic() - began)
            except (OSError, ValueError) as error:
                self.failures.append(f"{time.strftime('%H:%M:%S')} {error!r}")
            time.sleep(self.pause_s)

    def start(self) -> SteadyClient:
        self._thread = threading.Thread(target=self._loop, name="steady-client", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=120)

    def __enter__(self) -> SteadyClient:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
