"""Bad pairs on the real v1.20 apiserver: refused at apply, or reported once by the operator.

Issue 11, items 4, 5 and 9. Each case from the issue is either refused by the
apiserver at apply time (what the CRD's schema says: ranges, patterns,
maxItems) with a message naming the field, or, where v1.20 cannot say it
(it drops CEL rules; shapes the schema leaves free-form), stored and then
reported by the operator: ``Degraded=True, InvalidSpec`` with the field in
the message, one Warning Event, no child created, and no further writes on
later passes. A rejection that only the apiserver can make (a quota) is
reported the same way and clears once the cause is gone. The serving
options and ``nearTieMargin`` are checked both ways: refused out of range,
and rendered into the pod's config when valid.
"""

from __future__ import annotations

import copy
import json
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from tools.control_plane import ControlPlane

from tests.support.argocd_health import argocd_health
from tests.support.k8s_fixtures import Kubectl
from tests.support.operator_process import (
    Operator,
    condition,
    install_crds,
    pair_path,
    running_operator,
)
from tests.support.polling import PAIRS, get_or_none, wait_for

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SAMPLE: dict[str, Any] = yaml.safe_load((ROOT / "crds" / "samples" / "gpu-pair.yaml").read_text())
QUIET_SECONDS = 3.0  # three resync passes of the test operator (--resync-seconds 1)


def pair(name: str, **changes: Any) -> dict[str, Any]:
    """The GPU sample, planned at 80Gi, no Secrets, with ``a__b=value`` changes to its spec."""
    body = copy.deepcopy(SAMPLE)
    body["metadata"] = {"name": name}
    spec = body["spec"]
    spec["resources"]["gpuMemory"] = "80Gi"
    spec["replicas"] = 1
    del spec["hfTokenSecret"], spec["serving"]["apiKeySecret"]
    for dotted, value in changes.items():
        node = spec
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return body


def golden(count: int, prompt_chars: int, **expect: Any) -> dict[str, Any]:
    prompt = ("The capital of France is " * (prompt_chars // 25 + 1))[:prompt_chars]
    prompts = [
        {"name": f"g{i}", "prompt": prompt, "maxNewTokens": 8, "expect": expect}
        for i in range(count)
    ]
    return {"inline": prompts}


@pytest.fixture(scope="module")
def crds(control_plane: ControlPlane, kubectl: Kubectl) -> None:
    install_crds(kubectl)


@pytest.fixture
def operator(kubeconfig: Path, k8s_namespace: str, tmp_path: Path) -> Iterator[Operator]:
    with running_operator(kubeconfig, tmp_path, [k8s_namespace]) as running:
        yield running


def create(plane: ControlPlane, ns: str, body: dict[str, Any]) -> dict[str, Any]:
    return dict(plane.api("POST", PAIRS.format(ns=ns), body))


def get(plane: ControlPlane, path: str) -> dict[str, Any]:
    return dict(plane.api("GET", path))


def refusal(plane: ControlPlane, ns: str, body: dict[str, Any]) -> str:
    """The apiserver's 422 message for ``body``."""
    with pytest.raises(urllib.error.HTTPError) as raised:
        create(plane, ns, body)
    assert raised.value.code == 422, raised.value.code
    return str(json.loads(raised.value.read())["message"])


def warnings_for(plane: ControlPlane, ns: str, name: str) -> list[dict[str, Any]]:
    events = plane.api("GET", f"/api/v1/namespaces/{ns}/events").get("items") or []
    assert isinstance(events, list)
    return [e for e in events if e["involvedObject"]["name"] == name and e["type"] == "Warning"]


def children(plane: ControlPlane, ns: str, name: str) -> list[str]:
    """Objects the pair owns (by ownerReference: a 64-character name is no label value)."""
    found: list[str] = []
    for path in (
        f"/apis/apps/v1/namespaces/{ns}/deployments",
        f"/api/v1/namespaces/{ns}/services",
        f"/api/v1/namespaces/{ns}/configmaps",
    ):
        for item in get(plane, path).get("items") or []:
            owners = item["metadata"].get("ownerReferences") or []
            if any(ref["name"] == name for ref in owners):
                found.append(str(item["metadata"]["name"]))
    return found


def test_the_schema_refuses_at_apply(
    control_plane: ControlPlane, crds: None, k8s_namespace: str
) -> None:
    ns = k8s_namespace
    cases: list[tuple[dict[str, Any], str]] = [
        (pair("g0", resources__gpuMemory="0"), "spec.resources.gpuMemory"),
        (pair("g500m", resources__gpuMemory="500m"), "spec.resources.gpuMemory"),
        (
            pair("gbig", resources__gpuMemory="99999999999999999999999Ei"),
            "spec.resources.gpuMemory",
        ),
        (pair("m0", resources__gpus=0, resources__memory="0"), "spec.resources.memory"),
        (pair("p64", target__size__parameters=2**63 - 1), "spec.target.size.parameters"),
        (pair("gpus", resources__gpus=65), "spec.resources.gpus"),
        (pair("many", goldenPrompts=golden(65, 30)), "spec.goldenPrompts.inline"),
        (pair("long", goldenPrompts=golden(1, 4097)), "spec.goldenPrompts.inline.prompt"),
        (pair("step0", serving__maxStepTokens=0), "spec.serving.maxStepTokens"),
        (pair("header0", serving__headerTimeoutSeconds=0), "spec.serving.headerTimeoutSeconds"),
        (pair("body1k", serving__maxRequestBodyBytes=1000), "spec.serving.maxRequestBodyBytes"),
        (
            pair("margin", goldenPrompts={**golden(1, 30), "nearTieMargin": -1}),
            "spec.goldenPrompts.nearTieMargin",
        ),
    ]
    for body, field in cases:
        message = refusal(control_plane, ns, body)
        assert field in message, message
    # Issue 11's large specs: 5,000 inline prompts (~600 KB) and a 1.2 MB spec.
    for count, chars in ((5000, 60), (300, 4000)):
        body = pair(f"big-{count}", goldenPrompts=golden(count, chars))
        size = len(json.dumps(body))
        assert size > (1_100_000 if count == 300 else 550_000), size
        message = refusal(control_plane, ns, body)
        assert "spec.goldenPrompts.inline" in message and "at most 64 items" in message
    assert (control_plane.api("GET", PAIRS.format(ns=ns)).get("items") or []) == []


def test_what_v1_20_stores_the_operator_reports_once(
    control_plane: ControlPlane, crds: None, operator: Operator, k8s_namespace: str
) -> None:
    ns = k8s_namespace
    affinity_typo: dict[str, Any] = {"nodeAfinity": {}}
    bad_term = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In"}]}]
            }
        }
    }
    cases: list[tuple[dict[str, Any], str]] = [
        (pair("p" * 64), "metadata.name: "),
        (pair("pair.v2"), "metadata.name: 'pair.v2' is not a DNS-1035 label"),
        (pair("huge-gpu", resources__gpuMemory="9Ei"), "spec.resources.gpuMemory: '9Ei'"),
        (pair("affinity-shape", scheduling__affinity={"nodeAffinity": "zone-a"}), "affinity"),
        (pair("affinity-typo", scheduling__affinity=affinity_typo), "nodeAfinity"),
        (pair("affinity-values", scheduling__affinity=bad_term), "operator In needs values"),
        (
            pair(
                "exists-value",
                scheduling__tolerations=[{"key": "k", "operator": "Exists", "value": "v"}],
            ),
            "operator Exists must not have a value",
        ),
        (pair("golden-total", goldenPrompts=golden(64, 100, equals="y" * 5000)), "configMapRef"),
        (
            pair("same", draft__source=SAMPLE["spec"]["target"]["source"]),
            "draft.source must differ",
        ),
        (
            pair("deny-regex", serving__outputFilter={"denyPatterns": ["(unclosed"]}),
            "spec.serving.outputFilter.denyPatterns: item 0: '(unclosed' is not a valid regex",
        ),
        (
            pair("margin-ref", goldenPrompts={"configMapRef": {"name": "g"}, "nearTieMargin": 1}),
            "nearTieMargin applies to inline prompts only",
        ),
        # More than one GPU is for engine vllm only: a CEL rule, which v1.20 drops.
        (pair("gpus", resources__gpus=2), "spec.resources.gpus: resources.gpus must be 0 or 1"),
    ]
    for body, _ in cases:
        create(control_plane, ns, body)  # v1.20 stores every one of them

    def reported(name: str) -> dict[str, Any] | None:
        found = get_or_none(control_plane, pair_path(ns, name))
        degraded = condition(found, "Degraded")
        return found if degraded and degraded["status"] == "True" else None

    stored = {}
    for body, says in cases:
        name = body["metadata"]["name"]
        found = wait_for(lambda n=name: reported(n), f"Degraded on {name}")  # type: ignore[misc]
        degraded = condition(found, "Degraded")
        assert degraded is not None
        assert degraded["reason"] == "InvalidSpec" and says in degraded["message"], degraded
        assert found["status"]["observedGeneration"] == found["metadata"]["generation"]
        assert argocd_health(found)["status"] == "Degraded", name
        wait_for(lambda n=name: warnings_for(control_plane, ns, n), f"the Warning on {name}")  # type: ignore[misc]
        stored[name] = found["metadata"]["resourceVersion"]

    time.sleep(QUIET_SECONDS)  # later passes: no retries, no writes, no more Events
    for body, _ in cases:
        name = body["metadata"]["name"]
        after = get(control_plane, pair_path(ns, name))
        assert after["metadata"]["resourceVersion"] == stored[name], name
        assert len(warnings_for(control_plane, ns, name)) == 1, name
        assert children(control_plane, ns, name) == [], name
    assert "Traceback" not in operator.output()


def test_a_rejection_only_the_apiserver_can_make_is_reported_and_clears(
    control_plane: ControlPlane, crds: None, operator: Operator, k8s_namespace: str
) -> None:
    # A quota of no Services: the spec is fine, the namespace refuses the child (403).
    ns = k8s_namespace
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-services"},
        "spec": {"hard": {"services": "0"}},
    }
    control_plane.api("POST", f"/api/v1/namespaces/{ns}/resourcequotas", quota)
    create(control_plane, ns, pair("quota"))

    def degraded() -> dict[str, Any] | None:
        found = condition(get_or_none(control_plane, pair_path(ns, "quota")), "Degraded")
        return found if found and found["status"] == "True" else None

    cond = wait_for(degraded, "Degraded from the quota")
    assert "403" in cond["message"] and "no-services" in cond["message"], cond
    wait_for(lambda: warnings_for(control_plane, ns, "quota"), "the Warning Event")
    refused = get(control_plane, pair_path(ns, "quota"))
    assert argocd_health(refused)["status"] == "Degraded"
    # kstatus (Flux) reads a pair without these as ready.
    assert refused["status"]["observedGeneration"] == refused["metadata"]["generation"]
    assert (condition(refused, "Ready") or {}).get("status") == "False"
    time.sleep(QUIET_SECONDS)  # the next passes retry the Service, quietly
    assert len(warnings_for(control_plane, ns, "quota")) == 1

    control_plane.api("DELETE", f"/api/v1/namespaces/{ns}/resourcequotas/no-services")
    wait_for(
        lambda: get_or_none(control_plane, f"/api/v1/namespaces/{ns}/services/quota"),
        "the Service once the quota is gone",
    )
    wait_for(lambda: not degraded(), "Degraded cleared")


def test_the_largest_inline_golden_set_reconciles(
    control_plane: ControlPlane, crds: None, operator: Operator, k8s_namespace: str
) -> None:
    # Item 5: as many and as long inline prompts as the schema allows; kopf keeps no
    # copy of the spec on the object, so nothing grows past the annotation limit.
    ns = k8s_namespace
    body = pair("big-golden", goldenPrompts=golden(64, 3900))
    assert len(json.dumps(body)) > 250_000
    create(control_plane, ns, body)
    name = "big-golden"
    dep = wait_for(
        lambda: get_or_none(control_plane, f"/apis/apps/v1/namespaces/{ns}/deployments/{name}"),
        "the Deployment",
    )
    revision = dep["spec"]["template"]["metadata"]["labels"]["specpair.dev/revision"]
    config_map = get(control_plane, f"/api/v1/namespaces/{ns}/configmaps/{name}-{revision}")
    assert len(yaml.safe_load(config_map["data"]["golden.yaml"])["prompts"]) == 64
    found = get(control_plane, pair_path(ns, name))
    annotations = found["metadata"].get("annotations") or {}
    assert sum(len(k) + len(v) for k, v in annotations.items()) < 1024, annotations.keys()
    degraded = condition(found, "Degraded")
    assert degraded is None or degraded["status"] == "False", degraded


def test_valid_serving_options_pass_the_apiserver_and_reach_the_config(
    control_plane: ControlPlane, crds: None, operator: Operator, k8s_namespace: str
) -> None:
    ns, name = k8s_namespace, "options"
    serving = {"maxStepTokens": 64, "cudaGraphs": False, "drainTimeoutSeconds": 60}
    margin = {**golden(1, 30), "nearTieMargin": 0.25}
    create(control_plane, ns, pair(name, serving=serving, goldenPrompts=margin))
    dep = wait_for(
        lambda: get_or_none(control_plane, f"/apis/apps/v1/namespaces/{ns}/deployments/{name}"),
        "the Deployment",
    )
    pod = dep["spec"]["template"]
    assert pod["spec"]["terminationGracePeriodSeconds"] == 75
    revision = pod["metadata"]["labels"]["specpair.dev/revision"]
    data = get(control_plane, f"/api/v1/namespaces/{ns}/configmaps/{name}-{revision}")["data"]
    rendered = yaml.safe_load(data["runtime.yaml"])["serving"]
    assert (rendered["maxStepTokens"], rendered["cudaGraphs"]) == (64, False)
    assert rendered["drainTimeoutSeconds"] == 60
    assert yaml.safe_load(data["golden.yaml"])["nearTieMargin"] == 0.25
