"""specpair as users deploy it: real images on a real kubelet, installed with `helm install`.

Real, all of it: the images `make images` built (tools/images.py), the
control plane and one node of Kubernetes v1.20 started as a user starts them,
``python -m tools.control_plane_cli start --node`` (tools/node.py: kubelet
with dockershim on the project's Docker, kube-scheduler, kube-proxy, CNI), the
chart installed with helm (the operator runs as a pod under the chart's
ServiceAccount, RBAC on), and the runtime's containers, reached through their
Service's ClusterIP as a client in the cluster would. No stand-in anywhere.

The scenarios share one cluster, one release and one pair, and run in file
order; each leaves the pair serving for the next:

1. `helm install`; the CPU pair on the image's own demo models becomes
   Ready and answers an OpenAI request through its Service;
2. an upgrade to models on a PersistentVolumeClaim, with passing golden
   prompts, under steady traffic through the Service: no request fails, the
   new revision serves, and the operator's leader pod is deleted midway;
3. an upgrade whose golden prompts fail rolls back; the old pod serves on;
4. a knobs-only change reaches the running container through its
   ConfigMap volume, with no restart;
5. the serving pod, deleted, comes back; its draft, worse on the volume
   now, raises ``AcceptanceDrift``;
6. a pod stopped with requests in flight finishes them (the drain);
7. a revision whose container cannot start rolls back with the message the
   runtime wrote to ``/dev/termination-log``;
8. deleting the pair and `helm uninstall` leave no pods, containers or
   volumes behind;
9. SIGTERM stops the node and everything it started.

Where this machine cannot run the node (not root, no Docker, no cgroup
controllers), the module skips with the reason.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from tools.build_support import Progress, tail_file
from tools.control_plane_build import Binaries, default_cache_dir
from tools.deploy import (
    RELEASE,
    RELEASE_NAMESPACE,
    KubeconfigClient,
    SteadyClient,
    Tool,
    api,
    complete,
    condition,
    get_or_none,
    helm_install,
    helm_uninstall,
    model_card,
    pair_path,
    service_url,
)
from tools.docker_engine import Docker, ensure_docker
from tools.images import OPERATOR_IMAGE, RUNTIME_CPU_IMAGE
from tools.node import NODE_NAME, NodePaths, NodeUnavailable
from tools.node_network import BRIDGE

from tests.support.node_cli import NodeProcess
from tests.support.polling import PAIRS, wait_for
from tests.support.server_harness import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "e2e"
NAME = "chat"
CLAIM = "models"
PORT = 8000
SCRAPE_SECONDS = 2
OPERATOR_SA = f"{RELEASE}-specpair-operator"
PROMPTS = [
    "Hello, how can I help you today?",
    "My order has not arrived yet and",
    "The refund will appear on your card",
    "one two three four five",
]
# The demo pair baked into the CPU image (runtime/Dockerfile.cpu).
DEMO = ROOT / "crds" / "samples" / "cpu-pair.yaml"
TINY_SIZE = {"parameters": 200000, "layers": 2, "kvHeads": 2, "headDim": 16}


# --- the models on the volume --------------------------------------------------


@dataclass(frozen=True)
class Volume:
    """A host folder served to pods as PersistentVolumeClaim ``models``."""

    root: Path
    pv: str

    def source(self, relative: str) -> str:
        return f"pvc://{CLAIM}/{relative}"


def build_volume(root: Path) -> None:
    """v2 (a good pair), and a worse draft for the drift scenario, readable by UID 65532."""
    from tools.tiny_models import build_pair, save_model, save_pair

    save_pair(root / "v2", seed=1, draft_noise=0.05)
    unrelated = build_pair(seed=1, independent_draft=True)
    save_model(unrelated.draft, unrelated.tokenizer, root / "worse-draft")
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def volume_objects(volume: Volume) -> list[dict[str, Any]]:
    """A hostPath PersistentVolume bound to the claim, as an admin provisions one."""
    pv = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": volume.pv},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadOnlyMany"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "hostPath": {"path": str(volume.root), "type": "Directory"},
            "claimRef": {"namespace": NAMESPACE, "name": CLAIM},
        },
    }
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": CLAIM, "namespace": NAMESPACE},
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "storageClassName": "",
            "volumeName": volume.pv,
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }
    return [pv, pvc]


# --- the pair -----------------------------------------------------------------------


def demo_pair(version: str, runtime_image: str) -> dict[str, Any]:
    """The CPU sample as shipped: the image's demo models, sized for a surge beside it."""
    body: dict[str, Any] = yaml.safe_load(DEMO.read_text())
    body["metadata"] = {"name": NAME}
    spec = body["spec"]
    spec["version"] = version
    spec["runtimeImage"] = runtime_image
    # Two runtime pods (a rollout's surge) and the operator's fit on 2 cores.
    spec["resources"] = {"gpus": 0, "cpu": "500m", "memory": "2Gi"}
    spec["speculation"] = {"adaptive": False, "maxDepth": 4}
    spec["serving"] = {"port": PORT, "maxBatchSize": 4, "maxModelLength": 1024}
    spec["rollout"] = {"maxSurge": 1, "progressDeadlineSeconds": 240, "startupTimeoutSeconds": 180}
    # 480 drafted tokens span about ten completions: a stable baseline.
    spec["acceptanceDrift"] = {"tolerance": 0.3, "minDraftedTokens": 480}
    return body


def volume_spec(base: dict[str, Any], version: str, draft: str = "v2/draft") -> dict[str, Any]:
    spec: dict[str, Any] = json.loads(json.dumps(base["spec"]))
    spec["version"] = version
    for role, relative in (("target", "v2/target"), ("draft", draft)):
        spec[role] = {"source": f"pvc://{CLAIM}/{relative}", "dtype": "float32", "size": TINY_SIZE}
    return spec


def golden(expect: dict[str, Any]) -> dict[str, Any]:
    return {"inline": [{"name": "greeting", "prompt": PROMPTS[0], "expect": expect}]}


# --- the environment -----------------------------------------------------------------


@dataclass
class Env:
    node: NodeProcess
    plane: KubeconfigClient
    docker: Docker
    kubectl: Tool
    helm: Tool
    volume: Volume
    base: dict[str, Any] = field(default_factory=dict)

    def get(self, path: str) -> dict[str, Any]:
        return api(self.plane, "GET", path)

    def pair(self) -> dict[str, Any]:
        return self.get(pair_path(NAMESPACE, NAME))

    def status(self) -> dict[str, Any]:
        return dict(self.pair().get("status") or {})

    def patch_spec(self, spec: dict[str, Any]) -> None:
        self.kubectl(
            "patch",
            "speculativepair",
            NAME,
            "-n",
            NAMESPACE,
            "--type=merge",
            "-p",
            json.dumps({"spec": spec}),
        )

    def condition(self, type_: str) -> dict[str, Any]:
        return condition(self.pair(), type_)

    def pods(self, namespace: str = NAMESPACE) -> list[dict[str, Any]]:
        return list(self.get(f"/api/v1/namespaces/{namespace}/pods").get("items") or [])

    def ready_pods(self) -> list[dict[str, Any]]:
        def ready(pod: dict[str, Any]) -> bool:
            conditions = (pod.get("status") or {}).get("conditions") or []
            return not pod["metadata"].get("deletionTimestamp") and any(
                c["type"] == "Ready" and c["status"] == "True" for c in conditions
            )

        return [p for p in self.pods() if ready(p)]

    def url(self) -> str:
        return service_url(self.plane, NAMESPACE, NAME)

    def template_revision(self) -> str:
        dep = self.get(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{NAME}")
        return str(dep["spec"]["template"]["metadata"]["labels"]["specpair.dev/revision"])

    def live_pods(self) -> list[dict[str, Any]]:
        """Pods not being deleted: the kubelet v1.20 takes 10-60 s to remove a stopped one."""
        return [p for p in self.pods() if not p["metadata"].get("deletionTimestamp")]

    def settled_on(self, revision: str, ready: str = "True") -> bool:
        """The pair runs ``revision`` alone, rolled out; Ready as given."""
        status = self.status()
        pods = self.live_pods()
        return (
            status.get("currentRevision") == revision
            and self.condition("Ready").get("status") == ready
            and self.condition("Progressing").get("status") == "False"
            and len(pods) == 1
            and pods[0]["metadata"]["labels"]["specpair.dev/revision"] == revision
        )

    @contextlib.contextmanager
    def port_forward(self) -> Iterator[str]:
        """`kubectl port-forward service/<pair>` to a free loopback port; its URL."""
        port = free_port()
        argv = [str(self.kubectl.binary), "--kubeconfig", str(self.kubectl.kubeconfig)]
        argv += ["port-forward", "-n", NAMESPACE, f"service/{NAME}", f"{port}:{PORT}"]
        forward = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for(lambda: _listening(port), "kubectl port-forward", timeout=30)
            yield url
        finally:
            forward.terminate()
            forward.wait(timeout=30)

    def answers(self, prompt: str) -> bool:
        try:
            return bool(complete(self.url(), prompt)["choices"][0]["text"])
        except OSError:
            return False

    def served_versions(self, tries: int = 8) -> set[str]:
        """The pair versions answering through the Service (kube-proxy picks at random)."""
        return {str(model_card(self.url())["pair_version"]) for _ in range(tries)}

    def events(self, reason: str) -> list[dict[str, Any]]:
        found = self.get(f"/api/v1/namespaces/{NAMESPACE}/events").get("items") or []
        return [e for e in found if e.get("reason") == reason]

    def container(self, pod: dict[str, Any]) -> dict[str, Any]:
        """`docker inspect` of the pod's runtime container on the node."""
        status = pod["status"]["containerStatuses"][0]
        container_id = status["containerID"].removeprefix("docker://")
        inspected = self.docker.run("inspect", container_id).stdout
        found: dict[str, Any] = json.loads(inspected)[0]
        return found

    def operator_pods(self) -> list[dict[str, Any]]:
        return [
            p
            for p in self.pods(RELEASE_NAMESPACE)
            if p["metadata"]["labels"].get("app.kubernetes.io/name") == "specpair-operator"
        ]

    def logs(self, namespace: str, selector: str, tail: int = 80) -> str:
        done = self.kubectl(
            "logs", "-n", namespace, "-l", selector, f"--tail={tail}", "--prefix", check=False
        )
        return done.stdout + done.stderr

    def diagnostics(self) -> str:
        parts = [
            "operator logs:\n"
            + self.logs(RELEASE_NAMESPACE, "app.kubernetes.io/name=specpair-operator"),
            "runtime logs:\n" + self.logs(NAMESPACE, "app.kubernetes.io/name=specpair"),
        ]
        with contextlib.suppress(Exception):
            parts.append("pair status:\n" + json.dumps(self.status(), indent=1)[-4000:])
        described = self.kubectl("get", "pods,events", "-A", "-o", "wide", check=False)
        parts.append(described.stdout[-5000:])
        logs = [self.node.log, *sorted(NodePaths(default_cache_dir() / "node").logs.glob("*.log"))]
        if self.node.kubeconfig is not None:
            logs += sorted(self.node.kubeconfig.parent.glob("*.log"))
        parts += [f"--- {log} ---\n{tail_file(log, 15)}" for log in logs]
        return "\n".join(parts)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    """The node as `start --node` runs it: its kubeconfig, its Docker, kubectl and helm."""
    node = NodeProcess(tmp_path_factory.mktemp("node") / "start-node.log")
    try:
        kubeconfig = node.start()
    except NodeUnavailable as reason:
        node.stop()
        pytest.skip(f"the real node cannot run on this machine: {reason}")
    except BaseException:
        node.stop()
        raise
    try:
        binaries = Binaries.under(default_cache_dir())
        kubectl = Tool(binaries.kubectl, kubeconfig, timeout_s=120)
        helm = Tool(binaries.helm, kubeconfig, timeout_s=400)
        docker = ensure_docker(default_cache_dir(), Progress("[e2e]"))  # the node's: it runs
        root = tmp_path_factory.mktemp("volume")
        build_volume(root)
        volume = Volume(root, f"models-{root.name}")
        environment = Env(node, KubeconfigClient.load(kubeconfig), docker, kubectl, helm, volume)
        kubectl("create", "namespace", NAMESPACE)
        kubectl("apply", "-f", "-", input=yaml.safe_dump_all(volume_objects(volume)))
        yield environment
    finally:
        node.stop()


@contextlib.contextmanager
def diagnosed(env: Env) -> Iterator[None]:
    """On failure, print the operator's, the runtimes' and the node's logs."""
    try:
        yield
    except BaseException:
        print(env.diagnostics())
        raise


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def wait_revision_serving(env: Env, what: str, timeout: float = 240) -> str:
    def serving() -> str | None:
        revision = env.status().get("currentRevision")
        ready = env.condition("Ready").get("status") == "True"
        return str(revision) if revision and ready and env.ready_pods() else None

    return wait_for(serving, what, timeout=timeout, interval=0.5)


# --- the scenarios ------------------------------------------------------------------


def _with_drafts(acceptance: dict[str, Any] | None) -> dict[str, Any] | None:
    return acceptance if acceptance and acceptance.get("draftedTokens", 0) > 0 else None


def test_1_helm_install_then_a_pair_on_the_images_demo_models_answers(env: Env) -> None:
    with diagnosed(env):
        helm_install(
            env.helm,
            OPERATOR_IMAGE,
            {"scrapeSeconds": str(SCRAPE_SECONDS), "resyncSeconds": "5", "logLevel": "debug"},
        )
        operators = env.operator_pods()
        assert operators and all(p["spec"]["serviceAccountName"] == OPERATOR_SA for p in operators)
        assert all(p["spec"]["nodeName"] == NODE_NAME for p in operators)
        assert {p["spec"]["containers"][0]["image"] for p in operators} == {OPERATOR_IMAGE}
        env.base = demo_pair("demo-1", RUNTIME_CPU_IMAGE)
        env.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump(env.base))
        revision = wait_revision_serving(env, "the demo pair Ready")
        # Ready is the pod's; kube-proxy programs its endpoint a moment later.
        wait_for(lambda: env.answers(PROMPTS[0]), "the Service to answer", timeout=30)
        reply = complete(env.url(), PROMPTS[0])
        assert reply["choices"][0]["text"] and reply["usage"]["completion_tokens"] > 0
        with env.port_forward() as local:  # as from a laptop: through the apiserver
            assert complete(local, PROMPTS[0])["choices"] == reply["choices"]
        (pod,) = env.ready_pods()
        assert pod["spec"]["nodeName"] == NODE_NAME
        # What the image and the pod spec promise, as Docker runs it.
        container = env.container(pod)
        assert container["HostConfig"]["ReadonlyRootfs"] is True
        assert container["HostConfig"]["CapDrop"] in (["ALL"], ["all"])
        assert container["Config"]["User"].split(":")[0] == "65532"
        with SteadyClient(env.url(), PROMPTS) as load:
            # A pod whose speculation gauge reads off (a prompt step on the CPU) is
            # published at once, before any draft is counted: wait for drafts.
            accepted = wait_for(
                lambda: _with_drafts(env.status().get("acceptance")),
                "status.acceptance with drafted tokens",
                timeout=10 * SCRAPE_SECONDS + 60,
            )
        assert not load.failures, load.failures
        assert accepted["revision"] == revision and 0.0 < accepted["rate"] <= 1.0
        logs = env.logs(RELEASE_NAMESPACE, "app.kubernetes.io/name=specpair-operator", 400)
        assert "Forbidden" not in logs and " 403" not in logs, logs[-3000:]


def test_2_upgrade_with_passing_golden_prompts_fails_no_request(env: Env) -> None:
    """Models from a PersistentVolumeClaim; the operator's leader is deleted midway."""
    with diagnosed(env):
        old = env.status()["currentRevision"]
        spec = volume_spec(env.base, "v2")
        spec["goldenPrompts"] = golden({"notContains": ["no such text"]})
        with SteadyClient(env.url(), PROMPTS) as load:
            time.sleep(1)
            env.patch_spec(spec)
            new = wait_for(
                lambda: (r := env.template_revision()) != old and r,
                "the new revision's template",
                timeout=90,
            )
            leader = env.get(f"/apis/coordination.k8s.io/v1/namespaces/{RELEASE_NAMESPACE}/leases")
            holders = [i["spec"].get("holderIdentity") for i in leader.get("items") or []]
            env.kubectl(
                "delete",
                "pod",
                "-n",
                RELEASE_NAMESPACE,
                "--wait=false",
                *_pods_named(env.operator_pods(), holders),
            )
            wait_for(lambda: env.settled_on(new), "the new revision to roll out", timeout=240)
            time.sleep(2)  # requests keep flowing to the new pod alone
        assert not load.failures, load.failures
        assert load.ok > 0
        assert env.served_versions() == {"v2"}
        card = model_card(env.url())
        assert (card["target"], card["draft"]) == (
            "pvc://models/v2/target",
            "pvc://models/v2/draft",
        )
        history = {h["revision"]: h for h in env.status()["revisions"]}
        assert (history[old]["outcome"], history[new]["outcome"]) == ("Superseded", "Current")
        with SteadyClient(env.url(), PROMPTS):
            wait_for(
                lambda: {h["revision"]: h for h in env.status()["revisions"]}[new].get(
                    "baselineRate"
                ),
                "the new revision's baseline",
                timeout=10 * SCRAPE_SECONDS + 60,
            )


def _pods_named(pods: list[dict[str, Any]], holders: list[Any]) -> list[str]:
    """The pods among ``pods`` whose name a Lease holder names (or all, if none does)."""
    names = [p["metadata"]["name"] for p in pods]
    named = [n for n in names if any(isinstance(h, str) and n in h for h in holders)]
    return named or names


def test_3_failing_golden_prompts_roll_back_and_the_old_pod_serves_on(env: Env) -> None:
    with diagnosed(env):
        good = env.status()["currentRevision"]
        (good_pod,) = [p["metadata"]["name"] for p in env.ready_pods()]
        spec = volume_spec(env.base, "v3-bad")
        spec["goldenPrompts"] = golden({"contains": ["a phrase this model never says"]})
        with SteadyClient(env.url(), PROMPTS) as load:
            env.patch_spec(spec)
            bad = wait_for(
                lambda: (r := env.template_revision()) != good and r,
                "the bad revision's template",
                timeout=90,
            )
            degraded = wait_for(
                lambda: (c := env.condition("Degraded")).get("reason") == "RolloutFailed" and c,
                "the rollback",
                timeout=240,
            )
            wait_for(lambda: env.settled_on(good, ready="False"), "the good revision alone")
        assert not load.failures, load.failures
        assert "golden" in degraded["message"] and bad in degraded["message"], degraded
        assert [p["metadata"]["name"] for p in env.ready_pods()] == [good_pod]
        assert env.served_versions() == {"v2"}
        assert any(bad in e["message"] for e in env.events("RolledBack"))
        # Back to the good spec: the same revision, nothing rolls, Degraded clears.
        spec["version"], spec["goldenPrompts"] = "v2", golden({"notContains": ["no such text"]})
        env.patch_spec(spec)
        wait_for(
            lambda: env.condition("Degraded").get("status") == "False",
            "Degraded to clear",
            timeout=90,
        )
        assert env.template_revision() == good


def test_4_knobs_only_change_reaches_the_running_container(env: Env) -> None:
    with diagnosed(env):
        revision = env.template_revision()
        (pod,) = env.ready_pods()
        container_id = pod["status"]["containerStatuses"][0]["containerID"]
        env.patch_spec({"speculation": {"adaptive": False, "maxDepth": 2}})
        name = pod["metadata"]["name"]

        def reported() -> bool:
            done = env.kubectl("logs", "-n", NAMESPACE, name, check=False)
            return '"maxDepth": 2' in done.stdout or "'maxDepth': 2" in done.stdout

        wait_for(reported, "the runtime to apply the new knobs", timeout=120, interval=2)
        (same,) = env.ready_pods()
        status = same["status"]["containerStatuses"][0]
        assert same["metadata"]["uid"] == pod["metadata"]["uid"]
        assert (status["containerID"], status["restartCount"]) == (container_id, 0)
        assert env.template_revision() == revision
        wait_for(
            lambda: env.status()["speculation"]["maxDepth"] == 2,
            "the knobs in force in the status",
            timeout=90,
        )


def test_5_a_deleted_pod_comes_back_and_a_worse_draft_raises_drift(env: Env) -> None:
    with diagnosed(env):
        status = env.status()
        revision = status["currentRevision"]
        baseline = {h["revision"]: h for h in status["revisions"]}[revision]["baselineRate"]
        # The draft changes on the volume under the same source (an unpinned
        # model refreshed in place): same revision, no rollout; the next pod loads it.
        draft = env.volume.root / "v2" / "draft"
        shutil.rmtree(draft)
        shutil.copytree(env.volume.root / "worse-draft", draft)
        for path in [draft, *draft.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        (old,) = env.ready_pods()
        env.kubectl("delete", "pod", "-n", NAMESPACE, old["metadata"]["name"], "--wait=false")
        wait_for(
            lambda: any(p["metadata"]["uid"] != old["metadata"]["uid"] for p in env.ready_pods()),
            "the replacement pod",
            timeout=180,
        )
        # kube-proxy follows the new endpoint within a second or two.
        wait_for(lambda: env.answers(PROMPTS[1]), "the Service to answer again", timeout=30)
        with SteadyClient(env.url(), PROMPTS):
            degraded = wait_for(
                lambda: (c := env.condition("Degraded")).get("reason") == "AcceptanceDrift" and c,
                "AcceptanceDrift",
                timeout=20 * SCRAPE_SECONDS + 90,
            )
        acceptance = env.status()["acceptance"]
        assert acceptance["drift"] and acceptance["rate"] < baseline * 0.7
        assert f"{baseline:.3f}" in degraded["message"]
        assert env.template_revision() == revision


@dataclass
class Stream:
    """One streamed completion read to its end in a thread."""

    base: str
    max_tokens: int
    chunks: int = 0
    finish_reason: str | None = None
    done: bool = False
    error: str | None = None
    ended_at: float = 0.0
    thread: threading.Thread | None = None

    def run(self) -> None:
        target = urllib.parse.urlsplit(self.base)
        connection = http.client.HTTPConnection(target.netloc, timeout=120)
        body = {
            "prompt": PROMPTS[2],
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "ignore_eos": True,
        }
        try:
            connection.request(
                "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            reply = connection.getresponse()
            if reply.status != 200:
                self.error = f"HTTP {reply.status}: {reply.read()[:300]!r}"
                return
            for raw in reply:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line.removeprefix("data: "))
                    for choice in chunk.get("choices") or []:
                        self.chunks += 1
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        except (OSError, ValueError) as error:
            self.error = repr(error)
        finally:
            self.ended_at = time.monotonic()
            connection.close()

    def start(self) -> Stream:
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        return self


def test_6_a_stopped_pod_finishes_the_requests_in_flight(env: Env) -> None:
    with diagnosed(env):
        (pod,) = env.ready_pods()
        pod_url = f"http://{pod['status']['podIP']}:{PORT}"
        streams = [Stream(env.url(), max_tokens=900).start() for _ in range(4)]
        wait_for(lambda: all(s.chunks > 0 for s in streams), "the streams to start", timeout=60)
        env.kubectl("delete", "pod", "-n", NAMESPACE, pod["metadata"]["name"], "--wait=false")

        def draining() -> bool:
            try:
                urllib.request.urlopen(f"{pod_url}/readyz", timeout=2)
            except urllib.error.HTTPError as error:
                body: dict[str, Any] = json.loads(error.read() or b"{}")
                return body.get("phase") == "draining"
            except OSError:
                return False
            return False

        wait_for(draining, "the pod to get SIGTERM and drain", timeout=60, interval=0.1)
        in_flight = sum(not s.done and s.error is None for s in streams)
        for stream in streams:
            assert stream.thread is not None
            stream.thread.join(timeout=120)
        assert in_flight > 0, "every stream ended before SIGTERM: make them longer"
        assert [(s.error, s.done, s.finish_reason) for s in streams] == [
            (None, True, "length")
        ] * len(streams)
        wait_for(lambda: env.ready_pods(), "the replacement pod", timeout=180)
        wait_for(lambda: env.answers(PROMPTS[0]), "the Service to answer again", timeout=30)


def test_7_a_container_that_cannot_start_rolls_back_with_its_termination_message(
    env: Env,
) -> None:
    with diagnosed(env):
        good = env.status()["currentRevision"]
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "empty-key", "namespace": NAMESPACE},
            "data": {"key": base64.b64encode(b"").decode()},
        }
        env.kubectl("apply", "-f", "-", input=yaml.safe_dump(secret))
        spec = json.loads(json.dumps(env.pair()["spec"]))
        spec["version"] = "v4-no-key"
        spec["serving"]["apiKeySecret"] = {"name": "empty-key", "key": "key"}
        with SteadyClient(env.url(), PROMPTS) as load:
            env.patch_spec(spec)
            degraded = wait_for(
                lambda: (c := env.condition("Degraded")).get("reason") == "RolloutFailed" and c,
                "the rollback",
                timeout=240,
            )
            wait_for(lambda: env.settled_on(good, ready="False"), "the good revision alone")
        assert not load.failures, load.failures
        # The kubelet read it from /dev/termination-log, where the runtime wrote it.
        message = degraded["message"]
        assert "terminated: specpair-runtime serve: ConfigError: serving.apiKeyFile" in message
        assert "progressDeadlineSeconds" not in message


def test_8_deleting_the_pair_and_helm_uninstall_leave_nothing_behind(env: Env) -> None:
    with diagnosed(env):
        volumes_before = set(env.docker.run("volume", "ls", "-q").stdout.split())
        env.kubectl("delete", "speculativepair", NAME, "-n", NAMESPACE, "--wait=true")
        helm_uninstall(env.helm)
        for namespace in (NAMESPACE, RELEASE_NAMESPACE):

            def gone(ns: str = namespace) -> bool:
                return not env.pods(ns)

            wait_for(gone, f"no pods in {namespace}", timeout=120)
        assert get_or_none(env.plane, f"{PAIRS.format(ns=NAMESPACE)}/{NAME}") is None
        for kind in ("deployments", "services", "configmaps"):
            group = "apis/apps/v1" if kind == "deployments" else "api/v1"
            found = env.get(f"/{group}/namespaces/{NAMESPACE}/{kind}").get("items") or []
            owned = [o for o in found if o["metadata"].get("ownerReferences")]
            assert not owned, f"{kind} left: {[o['metadata']['name'] for o in owned]}"

        def containers() -> list[str]:
            listed = env.docker.run(
                "ps", "-aq", "--filter", "label=io.kubernetes.docker.type"
            ).stdout.split()
            return listed

        # The kubelet removes a deleted pod's sandbox in its minutely garbage collection.
        wait_for(lambda: not containers(), "no pod containers on the node", timeout=150)
        volumes_after = set(env.docker.run("volume", "ls", "-q").stdout.split())
        assert volumes_after <= volumes_before, volumes_after - volumes_before
        assert not volumes_after, f"docker volumes left: {volumes_after}"


def test_9_sigterm_stops_the_node_and_leaves_nothing_running(env: Env) -> None:
    assert env.node.stop() == 0
    assert subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode != 0
    rules = subprocess.run(["iptables-save"], capture_output=True, text=True, check=True).stdout
    assert "KUBE-" not in rules and "SPECPAIR-NODE" not in rules
    listed = env.docker.run("ps", "-aq", "--filter", "label=io.kubernetes.docker.type")
    assert not listed.stdout.split()
    root = (default_cache_dir() / "node").resolve()
    mounts = Path("/proc/self/mounts").read_text()
    assert str(root) not in mounts
    with pytest.raises(OSError):  # the apiserver is gone
        env.plane.api("GET", "/version")
    # kubelet, kube-proxy, the scheduler and the control plane all name its directory.
    assert env.node.kubeconfig is not None
    plane_dir = str(env.node.kubeconfig.parent)
    running = []
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if plane_dir in (proc / "cmdline").read_text(errors="replace"):
                running.append(proc.name)
    assert not running, f"node processes still running: {running}"
