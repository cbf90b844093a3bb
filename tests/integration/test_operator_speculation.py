"""A draft that never agrees: still serving, and the pair says the draft is not helping.

Real: the v1.20 apiserver and controller-manager, the operator process, and a
``specpair-runtime serve`` process for the pod, over a tiny target and a draft
of unrelated weights (tools/tiny_models.py: acceptance 0). The fake kubelet
plays the node. The operator scrapes the pod's ``/metrics`` every second:

1. over an interval of ``minDraftedTokens`` drafted tokens, acceptance stays
   below the break-even rate: ``SpeculationEffective=False, LowAcceptance``,
   a Warning Event, ``Ready`` still True, Argo CD still Healthy, saying why;
2. with ``speculation.acceptanceFloor`` set (a live knob), the runtime turns
   speculation off itself: the pair shows it (``RuntimeFellBack``, the pod in
   ``status.acceptance.speculationOff``) with a second Warning Event.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tools.control_plane import ControlPlane

from tests.support.argocd_health import argocd_health
from tests.support.fake_kubelet import FakeKubelet
from tests.support.k8s_fixtures import Kubectl
from tests.support.operator_process import Operator, condition, install_crds
from tests.support.pair_namespace import PairNamespace
from tests.support.polling import wait_for
from tests.support.server_harness import free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NAME = "never"
PROMPTS = ["Hello, how can I help you today?", "one two three four five", "def add(a, b):"]
# Size hints: the draft a tenth of the target, so drafting pays above acceptance 0.1.
TARGET_SIZE = {"parameters": 200000, "layers": 2, "kvHeads": 2, "headDim": 16}
DRAFT_SIZE = {**TARGET_SIZE, "parameters": 20000}


@pytest.fixture(scope="module")
def disagreeing_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tools.tiny_models import build_pair, save_model

    root = tmp_path_factory.mktemp("never")
    pair = build_pair(seed=0, independent_draft=True)
    target = save_model(pair.target, pair.tokenizer, root / "target")
    return target, save_model(pair.draft, pair.tokenizer, root / "draft")


def pair_body(models: tuple[Path, Path], port: int) -> dict[str, Any]:
    target, draft = models
    return {
        "apiVersion": "specpair.dev/v1alpha1",
        "kind": "SpeculativePair",
        "metadata": {"name": NAME},
        "spec": {
            "version": "v1",
            "target": {"source": str(target), "dtype": "float32", "size": TARGET_SIZE},
            "draft": {"source": str(draft), "dtype": "float32", "size": DRAFT_SIZE},
            "speculation": {"adaptive": False, "maxDepth": 4},
            "resources": {"gpus": 0, "cpu": "1", "memory": "2Gi"},
            "replicas": 1,
            "serving": {"port": port, "maxBatchSize": 2, "maxModelLength": 128},
            "acceptanceDrift": {"minDraftedTokens": 96},
        },
    }


@pytest.fixture
def cluster(
    control_plane: ControlPlane, kubectl: Kubectl, k8s_namespace: str, tmp_path: Path
) -> Iterator[tuple[PairNamespace, FakeKubelet, Operator]]:
    install_crds(kubectl)
    kubelet = FakeKubelet(control_plane, k8s_namespace, tmp_path / "kubelet")
    operator = Operator(
        control_plane.kubeconfig_path,
        tmp_path / "operator.log",
        [k8s_namespace],
        ["--scrape-seconds", "1"],
    )
    space = PairNamespace(control_plane, kubectl, k8s_namespace)
    try:
        kubelet.start()
        operator.start()
        yield space, kubelet, operator
    finally:
        operator.stop()
        with contextlib.suppress(OSError):
            space.kubectl("delete", "spair", "--all", "-n", k8s_namespace, "--wait=false")
        kubelet.stop()


def complete(base: str, prompt: str) -> None:
    body = json.dumps({"prompt": prompt, "max_tokens": 24, "temperature": 0.0}).encode()
    request = urllib.request.Request(
        f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert reply.status == 200


def speculation(space: PairNamespace) -> tuple[str, str] | None:
    cond = condition(space.get("pairs", NAME), "SpeculationEffective")
    return None if cond is None else (cond["status"], cond["reason"])


def serve_until(base: str, prompts: Iterator[str], done: Any, what: str) -> Any:
    """Send completions, one at a time, until ``done()`` holds (the scrape sees them)."""

    def probe() -> Any:
        complete(base, next(prompts))
        return done()

    return wait_for(probe, what, timeout=180, interval=0.5)


def test_a_draft_that_never_agrees_is_reported_while_the_pair_serves(
    cluster: tuple[PairNamespace, FakeKubelet, Operator], disagreeing_pair: tuple[Path, Path]
) -> None:
    space, kubelet, operator = cluster
    port = free_port()
    space.create(pair_body(disagreeing_pair, port))
    try:
        space.wait(
            "pairs",
            NAME,
            "Ready",
            lambda p: (condition(p, "Ready") or {}).get("status") == "True",
            timeout=180,
        )
        assert speculation(space) == ("Unknown", "NotMeasured")
        (running,) = [r for r in kubelet.started if r.process.poll() is None]
        base = f"http://{running.ip}:{running.port}"
        prompts = itertools.cycle(PROMPTS)

        serve_until(base, prompts, lambda: speculation(space) == ("False", "LowAcceptance"),
                    "SpeculationEffective=False, LowAcceptance")  # fmt: skip
        pair = space.pair(NAME)
        acceptance = pair["status"]["acceptance"]
        assert acceptance["rate"] == 0.0 and acceptance["draftedTokens"] >= 96
        cond = condition(pair, "SpeculationEffective")
        assert cond is not None
        assert (
            f"acceptance 0.000 over {acceptance['draftedTokens']} drafted tokens" in cond["message"]
        )
        assert "break-even rate 0.100" in cond["message"]
        # Still serving: Ready, not Degraded; Argo CD Healthy, saying the draft is not helping.
        assert (condition(pair, "Ready") or {})["status"] == "True"
        assert (condition(pair, "Degraded") or {})["status"] == "False"
        health = argocd_health(pair)
        assert health["status"] == "Healthy"
        assert "the draft is not helping: LowAcceptance" in health["message"]
        wait_for(lambda: "LowAcceptance" in space.event_reasons(), "the Warning Event")

        # The runtime's own fallback: a floor it is below, as a live knob (no restart).
        space.patch(
            NAME, {"spec": {"speculation": {"acceptanceFloor": 0.5, "acceptanceWindow": 4}}}
        )
        fell_back = serve_until(
            base,
            prompts,
            lambda: speculation(space) == ("False", "RuntimeFellBack"),
            "SpeculationEffective=False, RuntimeFellBack",
        )
        assert fell_back
        pair = space.pair(NAME)
        off = pair["status"]["acceptance"]["speculationOff"]
        assert off == [{"pod": running.name, "reason": "acceptance_floor"}]
        cond = condition(pair, "SpeculationEffective")
        assert cond is not None and "acceptanceFloor 0.500" in cond["message"]
        assert f"on {running.name}:" in cond["message"]
        wait_for(lambda: "RuntimeFellBack" in space.event_reasons(), "the second Warning Event")
        complete(base, PROMPTS[0])  # and it still serves, target-only
        assert (condition(space.pair(NAME), "Ready") or {})["status"] == "True"
    except BaseException:
        print(operator.output()[-6000:], kubelet.logs()[-4000:], sep="\n")
        raise
