"""Rollout, rollback, live knobs and acceptance drift, end to end on one machine.

Real: the kube-apiserver and controller-manager (v1.20, on loopback), the
operator process (`python -m specpair_operator run`), and one
``specpair-runtime serve`` process per pod, with tiny models built in code.
The one stand-in is `tests.support.fake_kubelet.FakeKubelet`, which plays
the node (there is no kubelet here). Clients reach the pods through their pod
IPs (127.0.0.2, …), choosing among the Ready pods as a Service would (a
loopback address may not go into an Endpoints object, so the test reads the
pods itself).

The scenarios share one pair and run in file order; each leaves the pair
Ready for the next:

1. a CPU pair becomes Ready, serves a completion, and shows its acceptance;
2. a version bump to a new pair rolls both models together, no request
   fails, and the operator is restarted in the middle of it (scenario 6);
3. a bad pair (a draft with another tokenizer) is rolled back with the
   failing check named, and the old pods serve throughout;
4. a knobs-only change restarts nothing, and the runtime applies the knobs;
5. a draft that agrees worse (swapped in place, as with an unpinned source)
   lowers the acceptance below the baseline: ``AcceptanceDrift``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
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
from tests.support.operator_process import install_crds
from tests.support.polling import PAIRS, wait_for
from tests.support.server_harness import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
NAME = "chat"
SCRAPE_SECONDS = 2
PROMPTS = [
    "Hello, how can I help you today?",
    "My order has not arrived yet and",
    "The refund will appear on your card",
    "one two three four five",
]


# --- models ---------------------------------------------------------------


@dataclass(frozen=True)
class Models:
    first: tuple[Path, Path]  # (target, draft) of version 1
    second: tuple[Path, Path]  # a new good pair for version 2
    foreign_draft: Path  # same architecture, another tokenizer
    worse_draft: Path  # the second target's tokenizer, unrelated weights


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    from tools.tiny_models import (
        build_llama,
        build_pair,
        build_tokenizer,
        save_model,
        save_pair,
    )

    root = tmp_path_factory.mktemp("models")
    first = save_pair(root / "v1", seed=0, draft_noise=0.05)
    second = save_pair(root / "v2", seed=1, draft_noise=0.05)
    other = build_tokenizer(extra_corpus=("zebra quartz xylophone", "quixotic jazz vex"))
    foreign = save_model(build_llama(other, seed=7), other, root / "foreign-draft")
    unrelated = build_pair(seed=1, independent_draft=True)
    worse = save_model(unrelated.draft, unrelated.tokenizer, root / "worse-draft")
    return Models(first, second, foreign, worse)


def model(path: Path) -> dict[str, Any]:
    return {
        "source": str(path),
        "dtype": "float32",
        "size": {"parameters": 200000, "layers": 2, "kvHeads": 2, "headDim": 16},
    }


def pair_body(version: str, target: Path, draft: Path, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "specpair.dev/v1alpha1",
        "kind": "SpeculativePair",
        "metadata": {"name": NAME},
        "spec": {
            "version": version,
            "target": model(target),
            "draft": model(draft),
            "speculation": {"adaptive": False, "maxDepth": 4},
            "resources": {"gpus": 0, "cpu": "1", "memory": "2Gi"},
            "replicas": 1,
            "serving": {"port": port, "maxBatchSize": 4, "maxModelLength": 256},
            "rollout": {"maxSurge": 1, "progressDeadlineSeconds": 120},
            # A window of 48 drafted tokens held about one completion, so the rate was
            # one prompt's: a baseline of 0.470 then read 0.247 on the next prompts,
            # and Degraded=AcceptanceDrift flapped on a healthy pair. 480 tokens span
            # about ten completions, more than two rounds of PROMPTS.
            "acceptanceDrift": {"tolerance": 0.3, "minDraftedTokens": 480},
        },
    }


# --- the operator ------------------------------------------------------------


class Operator:
    """`python -m specpair_operator run` as a child process; always stopped."""

    def __init__(self, kubeconfig: Path, log: Path, namespace: str) -> None:
        self.kubeconfig, self.log, self.namespace = kubeconfig, log, namespace
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = [
            sys.executable,
            "-m",
            "specpair_operator",
            "run",
            "--namespace",
            self.namespace,
            "--resync-seconds",
            "1",
            "--scrape-seconds",
            str(SCRAPE_SECONDS),
            "--metrics-port",
            "0",
        ]
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def restart(self) -> None:
        self.stop()
        self.start()


# --- traffic ------------------------------------------------------------------


def complete(ip: str, port: int, prompt: str, max_tokens: int = 24) -> dict[str, Any]:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}).encode()
    request = urllib.request.Request(
        f"http://{ip}:{port}/v1/completions",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        result: dict[str, Any] = json.loads(reply.read())
        return result


@dataclass
class Traffic:
    """Completions in a loop against the Ready pods, as a Service would spread them."""

    env: Env
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _loop(self) -> None:
        prompts = itertools.cycle(PROMPTS)
        turn = itertools.count()
        while not self._stop.is_set():
            ready = self.env.ready_pods()
            if not ready:
                time.sleep(0.2)
                continue
            pod = ready[next(turn) % len(ready)]
            ip = pod["status"]["podIP"]
            try:
                complete(ip, self.env.port, next(prompts))
                self.ok += 1
            except (OSError, ValueError) as error:
                self.failures.append(f"{pod['metadata']['name']} ({ip}): {error!r}")
            time.sleep(0.05)

    def start(self) -> Traffic:
        self._thread = threading.Thread(target=self._loop, name="traffic", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=90)


@contextlib.contextmanager
def traffic(env: Env) -> Iterator[Traffic]:
    load = Traffic(env).start()
    try:
        yield load
    finally:
        load.stop()


# --- the environment -------------------------------------------------------------


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

    def get(self, path: str) -> dict[str, Any]:
        return dict(self.plane.api("GET", path))

    def pair(self) -> dict[str, Any]:
        return self.get(self.pair_path)

    def patch_spec(self, spec: dict[str, Any]) -> None:
        request = urllib.request.Request(
            self.plane.server_url + self.pair_path,
            data=json.dumps({"spec": spec}).encode(),
            method="PATCH",
            headers={
                "Authorization": f"Bearer {self.plane.admin_token}",
                "Content-Type": "application/merge-patch+json",
            },
        )
        from tools.control_plane import _ssl_context

        with urllib.request.urlopen(request, context=_ssl_context(self.plane.ca_path), timeout=30):
            pass

    def condition(self, type_: str) -> dict[str, Any]:
        for cond in (self.pair().get("status") or {}).get("conditions") or []:
            if cond["type"] == type_:
                return dict(cond)
        return {}

    def pods(self) -> list[dict[str, Any]]:
        found = self.get(f"/api/v1/namespaces/{self.namespace}/pods").get("items") or []
        return list(found)

    def ready_pods(self) -> list[dict[str, Any]]:
        def ready(pod: dict[str, Any]) -> bool:
            conds = (pod.get("status") or {}).get("conditions") or []
            return not pod["metadata"].get("deletionTimestamp") and any(
                c["type"] == "Ready" and c["status"] == "True" for c in conds
            )

        return [p for p in self.pods() if ready(p) and p["status"].get("podIP")]

    def template_revision(self) -> str:
        dep = self.get(f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{NAME}")
        return str(dep["spec"]["template"]["metadata"]["labels"]["specpair.dev/revision"])

    def events(self, reason: str) -> list[dict[str, Any]]:
        found = self.get(f"/api/v1/namespaces/{self.namespace}/events").get("items") or []
        return [e for e in found if e.get("reason") == reason]

    def settled_on(self, revision: str, ready: str = "True") -> bool:
        """The pair runs ``revision`` alone, rolled out; Ready as given.

        Ready means serving at the spec's revision: after a rollback the pair
        serves the last good revision, not the spec's, so Ready is "False".
        """
        status = self.pair().get("status") or {}
        pods = self.pods()
        return (
            status.get("currentRevision") == revision
            and self.condition("Ready").get("status") == ready
            and self.condition("Progressing").get("status") == "False"
            and len(pods) == 1
            and pods[0]["metadata"]["labels"]["specpair.dev/revision"] == revision
        )

    def diagnostics(self) -> str:
        text = f"operator log:\n{self.operator.log.read_text(errors='replace')[-6000:]}\n"
        try:  # the pair's conditions say which rule fired (Degraded has several reasons)
            status = self.pair().get("status") or {}
            text += "pair conditions:\n" + json.dumps(status.get("conditions"), indent=1) + "\n"
            text += "pair acceptance:\n" + json.dumps(status.get("acceptance")) + "\n"
        except Exception as error:  # diagnostics must not hide the failure
            text += f"pair status unreadable: {error}\n"
        return text + f"pods:\n{self.kubelet.logs()}"


@pytest.fixture(scope="module")
def env(
    control_plane: ControlPlane,
    kubectl: Kubectl,
    models: Models,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Env]:
    install_crds(kubectl)
    namespace = f"e2e-{uuid.uuid4().hex[:8]}"
    control_plane.ensure_namespace(namespace)
    work = tmp_path_factory.mktemp("e2e")
    kubelet = FakeKubelet(control_plane, namespace, work / "kubelet")
    operator = Operator(control_plane.kubeconfig_path, work / "operator.log", namespace)
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
        if os.environ.get("SPECPAIR_E2E_KEEP"):
            print(environment.diagnostics())


@contextlib.contextmanager
def diagnosed(env: Env) -> Iterator[None]:
    """On failure, print the operator's and the runtimes' logs (pytest shows them)."""
    try:
        yield
    except BaseException:
        print(env.diagnostics())
        raise


# --- the scenarios -----------------------------------------------------------------


def test_1_cpu_pair_becomes_ready_serves_and_reports_acceptance(env: Env) -> None:
    target, draft = env.models.first
    body = pair_body("v1", target, draft, env.port)
    with diagnosed(env):
        env.plane.api("POST", PAIRS.format(ns=env.namespace), body)
        revision = wait_for(
            lambda: (env.pair().get("status") or {}).get("currentRevision"),
            "the first revision to become current",
            timeout=150,
        )
        assert env.condition("Ready")["status"] == "True"
        pod = env.ready_pods()[0]
        assert pod["status"]["podIP"].startswith("127.0.0.")
        reply = complete(pod["status"]["podIP"], env.port, PROMPTS[0])
        assert reply["choices"][0]["text"]
        with traffic(env) as load:
            accepted = wait_for(
                lambda: env.pair()["status"].get("acceptance") or None,
                "status.acceptance",
                timeout=10 * SCRAPE_SECONDS + 30,
            )
        assert not load.failures, load.failures
        assert accepted["revision"] == revision
        assert accepted["draftedTokens"] >= 48
        assert 0.0 < accepted["rate"] <= 1.0
        assert accepted["meanAcceptedLength"] > 0.0
        assert accepted["speculationOff"] == []
        history = env.pair()["status"]["revisions"]
        assert [(h["revision"], h["version"], h["outcome"], h["current"]) for h in history] == [
            (revision, "v1", "Current", True)
        ]
        assert 0.0 < history[0]["baselineRate"] <= 1.0  # the first settled acceptance


def test_2_version_bump_rolls_both_models_and_survives_an_operator_restart(env: Env) -> None:
    """Scenarios 2 and 6: the operator is restarted while the new pods start."""
    with diagnosed(env):
        old = env.pair()["status"]["currentRevision"]
        target, draft = env.models.second
        with traffic(env) as load:
            time.sleep(1)
            env.patch_spec(pair_body("v2", target, draft, env.port)["spec"])
            new = wait_for(
                lambda: (r := env.template_revision()) != old and r,
                "the new revision's template",
                timeout=90,
            )
            env.operator.restart()  # scenario 6, in the middle of the rollout
            wait_for(lambda: env.settled_on(new), "the new revision to roll out", timeout=150)
        assert not load.failures, load.failures
        assert load.ok > 0
        pod = env.ready_pods()[0]
        card = json.loads(
            urllib.request.urlopen(f"http://{pod['status']['podIP']}:{env.port}/v1/models").read()
        )["data"][0]
        # One pod template carries both: the new target and the new draft together.
        assert (card["target"], card["draft"], card["pair_version"]) == (
            str(target),
            str(draft),
            "v2",
        )
        history = {h["revision"]: h for h in env.pair()["status"]["revisions"]}
        assert (history[old]["outcome"], history[old]["current"]) == ("Superseded", False)
        assert (history[new]["outcome"], history[new]["version"]) == ("Current", "v2")
        assert env.condition("Degraded")["status"] == "False"
        # The baseline of the new revision, from its own first settled acceptance.
        with traffic(env):
            wait_for(
                lambda: {h["revision"]: h for h in env.pair()["status"]["revisions"]}[new].get(
                    "baselineRate"
                ),
                "the new revision's baseline",
                timeout=10 * SCRAPE_SECONDS + 30,
            )


def test_3_bad_pair_is_rolled_back_with_the_failing_check_named(env: Env) -> None:
    with diagnosed(env):
        good = env.pair()["status"]["currentRevision"]
        good_pod = env.ready_pods()[0]["metadata"]["name"]
        target, _ = env.models.second
        with traffic(env) as load:
            env.patch_spec(pair_body("v3-bad", target, env.models.foreign_draft, env.port)["spec"])
            bad = wait_for(
                lambda: (r := env.template_revision()) != good and r,
                "the bad revision's template",
                timeout=90,
            )
            degraded = wait_for(
                lambda: (c := env.condition("Degraded")).get("reason") == "RolloutFailed" and c,
                "the rollback",
                timeout=120,
            )
            wait_for(
                lambda: env.settled_on(good, ready="False"),
                "the good revision alone again",
                timeout=60,
            )
        assert not load.failures, load.failures
        assert degraded["status"] == "True"
        # The runtime's alignment check, as its /readyz said it.
        assert "/readyz failed" in degraded["message"] and bad in degraded["message"]
        assert "vocab" in degraded["message"]
        assert env.template_revision() == good
        assert env.ready_pods()[0]["metadata"]["name"] == good_pod  # it served throughout
        assert any(bad in e["message"] for e in env.events("RolledBack"))
        history = {h["revision"]: h for h in env.pair()["status"]["revisions"]}
        assert history[bad]["outcome"] == "RolledBack" and history[good]["current"]
        pair = env.pair()
        assert pair["metadata"]["annotations"]["specpair.dev/failed-revision"] == bad
        time.sleep(3)  # no retry of the failed revision while its spec stays
        assert env.template_revision() == good
        # The status says which version serves: not the spec's, so not Ready.
        assert env.condition("Ready")["reason"] == "RolledBack"
        assert env.pair()["status"]["servingVersion"] == "v2"
        assert env.pair()["status"]["desiredVersion"] == "v3-bad"
        # Back to the good spec: the same revision, nothing rolls, Degraded clears.
        env.patch_spec(pair_body("v2", target, env.models.second[1], env.port)["spec"])
        wait_for(
            lambda: env.condition("Degraded").get("status") == "False",
            "Degraded to clear",
            timeout=90,
        )
        assert env.template_revision() == good


def test_4_knobs_only_change_restarts_nothing(env: Env) -> None:
    with diagnosed(env):
        revision = env.template_revision()
        pod = env.ready_pods()[0]
        running = env.kubelet.pod_by_name(pod["metadata"]["name"])
        assert running is not None
        pid = running.process.pid
        env.patch_spec({"speculation": {"adaptive": False, "maxDepth": 2}})
        wait_for(
            lambda: '"maxDepth": 2' in running.log() or "'maxDepth': 2" in running.log(),
            "the runtime to report the new knobs",
            timeout=60,
        )
        assert running.process.poll() is None and running.process.pid == pid
        assert [p["metadata"]["uid"] for p in env.pods()] == [pod["metadata"]["uid"]]
        assert env.template_revision() == revision
        wait_for(
            lambda: env.pair()["status"]["speculation"]["maxDepth"] == 2,
            "the knobs in force in the status",
            timeout=90,
        )


def test_5_a_worse_draft_raises_acceptance_drift(env: Env) -> None:
    with diagnosed(env):
        status = env.pair()["status"]
        revision = status["currentRevision"]
        baseline = {h["revision"]: h for h in status["revisions"]}[revision]["baselineRate"]
        # The draft's files change under the same source (as with an unpinned
        # hf:// model or a refreshed volume): same revision, so no rollout, and
        # the baseline stays. The next pod loads the worse draft.
        _, draft = env.models.second
        shutil.rmtree(draft)
        shutil.copytree(env.models.worse_draft, draft)
        old = env.ready_pods()[0]
        env.plane.api(
            "DELETE", f"/api/v1/namespaces/{env.namespace}/pods/{old['metadata']['name']}"
        )
        wait_for(
            lambda: any(p["metadata"]["uid"] != old["metadata"]["uid"] for p in env.ready_pods()),
            "the replacement pod",
            timeout=120,
        )
        with traffic(env):
            degraded = wait_for(
                lambda: (c := env.condition("Degraded")).get("reason") == "AcceptanceDrift" and c,
                "AcceptanceDrift",
                timeout=15 * SCRAPE_SECONDS + 30,
            )
        acceptance = env.pair()["status"]["acceptance"]
        assert acceptance["drift"] and acceptance["rate"] < baseline * 0.7
        assert degraded["status"] == "True" and f"{baseline:.3f}" in degraded["message"]
        assert env.events("AcceptanceDrift")
        assert env.template_revision() == revision
