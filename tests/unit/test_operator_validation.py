"""What the apiserver lets through but Kubernetes would refuse later: the operator's checks.

Each case of issue 11, item 4 (and the bounds of items 5 and 9) must fail in
`api.parse_pair` with a message naming the field, so the operator reports it
as ``Degraded=InvalidSpec`` instead of failing on a child or on its status.
The same cases run against the real apiserver in
tests/integration/test_operator_invalid_specs.py.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from specpair_operator import api, builders
from specpair_operator.api import SpecError, parse_pair
from specpair_operator.headroom import DeviceMemory, plan_for_spec

ROOT = Path(__file__).resolve().parents[2]
SAMPLE: dict[str, Any] = yaml.safe_load((ROOT / "crds/samples/gpu-pair.yaml").read_text())
INT64_MAX = 2**63 - 1

# A core/v1 Affinity as in the Kubernetes docs ("Assign Pods to Nodes").
GOOD_AFFINITY: dict[str, Any] = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In",
                                       "values": ["antarctica-east1", "antarctica-west1"]}]}
            ]
        },
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 1, "preference": {"matchExpressions": [
                {"key": "another-node-label-key", "operator": "In",
                 "values": ["another-node-label-value"]}]}}
        ],
    },
    "podAntiAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "podAffinityTerm": {
                "labelSelector": {"matchExpressions": [
                    {"key": "security", "operator": "In", "values": ["S2"]}]},
                "topologyKey": "topology.kubernetes.io/zone"}}
        ]
    },
}  # fmt: skip


def pair(name: str = "llama-8b-1b", **changes: Any) -> dict[str, Any]:
    """The GPU sample with ``a__b=value`` changes to its spec."""
    body = copy.deepcopy(SAMPLE)
    body["metadata"] = {"name": name}
    for dotted, value in changes.items():
        node = body["spec"]
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return body


def rejected(body: dict[str, Any]) -> str:
    with pytest.raises(SpecError) as raised:
        parse_pair(body)
    return str(raised.value)


def test_the_samples_pass() -> None:
    parse_pair(pair())
    parse_pair(yaml.safe_load((ROOT / "crds/samples/cpu-pair.yaml").read_text()))


@pytest.mark.parametrize(
    ("body", "field", "says"),
    [
        (pair(name="p" * 64), "metadata.name", "at most 63"),
        (pair(name="pair.v2"), "metadata.name", "DNS-1035"),
        (pair(resources__gpuMemory="0"), "spec.resources.gpuMemory", "more than 0"),
        (pair(resources__gpuMemory="500m"), "spec.resources.gpuMemory", "no milli suffix"),
        (pair(resources__gpuMemory="99999999999999999999999Ei"), "spec.resources.gpuMemory", ""),
        (pair(resources__gpuMemory="2Ei"), "spec.resources.gpuMemory", "more than 1Ei"),
        (pair(resources__memory="0"), "spec.resources.memory", "more than 0"),
        (pair(target__size__parameters=INT64_MAX), "spec.target.size.parameters", ""),
        (pair(scheduling__affinity={"nodeAffinity": "zone-a"}), "spec.scheduling.affinity", ""),
        (
            pair(scheduling__affinity={"nodeAfinity": {}}),  # a typo
            "spec.scheduling.affinity",
            "nodeAfinity",
        ),
        (
            pair(
                scheduling__affinity={
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {"matchExpressions": [{"key": "zone", "operator": "In"}]}
                            ]
                        }
                    }
                }
            ),
            "spec.scheduling.affinity",
            "operator In needs values",
        ),
        (
            pair(
                scheduling__affinity={
                    "podAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": [{"labelSelector": {}}]
                    }
                }
            ),
            "spec.scheduling.affinity",
            "topologyKey",
        ),
        (
            pair(scheduling__tolerations=[{"key": "gpu", "operator": "Exists", "value": "yes"}]),
            "spec.scheduling.tolerations.0",
            "operator Exists must not have a value",
        ),
        (
            pair(scheduling__tolerations=[{"operator": "Equal", "value": "yes"}]),
            "spec.scheduling.tolerations.0",
            "without a key needs operator Exists",
        ),
        (
            pair(scheduling__nodeSelector={"bad key!": "x"}),
            "spec.scheduling.nodeSelector",
            "label key",
        ),
        (
            pair(scheduling__nodeSelector={"pool": "a" * 64}),
            "spec.scheduling.nodeSelector",
            "label value",
        ),
        (pair(serving__apiKeySecret={"name": "Api_Key", "key": "k"}), "apiKeySecret.name", ""),
        (
            pair(serving__maxStepTokens=0),
            "spec.serving.maxStepTokens",
            "greater than or equal to 1",
        ),
        (pair(serving__maxRequestBodyBytes=1023), "spec.serving.maxRequestBodyBytes", "1024"),
        (
            pair(serving__maxRequestBodyBytes=2**63),
            "spec.serving.maxRequestBodyBytes",
            "1073741824",
        ),
        (
            pair(serving__headerTimeoutSeconds=0),
            "spec.serving.headerTimeoutSeconds",
            "greater than 0",
        ),
        (pair(serving__bodyTimeoutSeconds=-1), "spec.serving.bodyTimeoutSeconds", "greater than 0"),
        (pair(serving__drainTimeoutSeconds=7200), "spec.serving.drainTimeoutSeconds", "3600"),
        (pair(serving__cudaGraphs=[]), "spec.serving.cudaGraphs", "boolean"),
        (pair(serving__prefillOrder="fifo"), "spec.serving.prefillOrder", "'shortest-first'"),
        (pair(serving__prefixReuse="sometimes"), "spec.serving.prefixReuse", "boolean"),
        (pair(serving__cpuThreads=0), "spec.serving.cpuThreads", "greater than or equal to 1"),
        (pair(serving__cpuThreads=2048), "spec.serving.cpuThreads", "1024"),
        (
            pair(serving__outputFilter={"denyPatterns": ["ok", "(unclosed"]}),
            "spec.serving.outputFilter.denyPatterns",
            "item 1: '(unclosed' is not a valid regex",
        ),
        (
            pair(serving__outputFilter={"denyPatterns": ["x" * 1025]}),
            "spec.serving.outputFilter.denyPatterns.0",
            "1024",
        ),
        (
            pair(goldenPrompts__nearTieMargin=-0.5),
            "spec.goldenPrompts.nearTieMargin",
            "greater than or equal to 0",
        ),
        (pair(resources__gpus=2), "spec.resources.gpus", "the runtime serves the pair on one GPU"),
    ],
)
def test_each_case_names_its_field(body: dict[str, Any], field: str, says: str) -> None:
    message = rejected(body)
    assert field in message and says in message, message
    assert len(message.splitlines()) == 1


def test_a_plan_that_overflows_int64_is_refused() -> None:
    huge = {"parameters": 10**12, "layers": 1024, "kvHeads": 1024, "headDim": 4096}
    message = rejected(
        pair(target__size=huge, serving__maxBatchSize=1024, serving__maxModelLength=1048576)
    )
    assert message.startswith("spec: the pair would need") and "serving.maxBatchSize" in message


def test_accepted_extremes_fit_status_int64() -> None:
    """The largest numbers the checks let through still fit status's int64 fields."""
    big = {"parameters": 10**15, "layers": 64, "kvHeads": 64, "headDim": 256}
    spec = parse_pair(
        pair(
            target__size=big, draft__size=big, resources__gpuMemory="1Ei", serving__maxBatchSize=64
        )
    )
    plan = plan_for_spec(spec, DeviceMemory(2**60, "spec.resources.gpuMemory", cuda=True))
    numbers = [plan.required_bytes, plan.device_bytes, plan.headroom_bytes, plan.overhead_bytes]
    numbers += [plan.target.weights_bytes, plan.target.kv_cache_bytes]
    assert all(-INT64_MAX <= n <= INT64_MAX for n in numbers)


def test_a_valid_affinity_reaches_the_pod_unchanged() -> None:
    spec = parse_pair(pair(scheduling__affinity=GOOD_AFFINITY))
    ref = builders.PairRef("llama-8b-1b", "ns", "uid-1")
    dep = builders.deployment(ref, spec, "r1")
    assert dep["spec"]["template"]["spec"]["affinity"] == GOOD_AFFINITY


def test_tolerations_that_core_v1_accepts_pass() -> None:
    parse_pair(
        pair(
            scheduling__tolerations=[
                {"operator": "Exists"},
                {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},
                {"key": "gpu", "operator": "Equal", "value": "a100", "effect": "NoExecute",
                 "tolerationSeconds": 300},
            ]
        )
    )  # fmt: skip


def golden(count: int, prompt: str = "The capital of France is", **expect: Any) -> dict[str, Any]:
    return {
        "inline": [
            {"name": f"g{i}", "prompt": prompt, "maxNewTokens": 8, "expect": expect}
            for i in range(count)
        ]
    }


def test_inline_golden_prompts_are_bounded() -> None:
    parse_pair(pair(goldenPrompts=golden(api.MAX_INLINE_GOLDEN_PROMPTS)))
    too_many = rejected(pair(goldenPrompts=golden(api.MAX_INLINE_GOLDEN_PROMPTS + 1)))
    assert "spec.goldenPrompts.inline" in too_many and "at most 64" in too_many
    too_long = rejected(pair(goldenPrompts=golden(1, "x" * (api.MAX_GOLDEN_PROMPT_LENGTH + 1))))
    assert "spec.goldenPrompts.inline.0.prompt" in too_long
    # Within both bounds, but large expectations: the total decides, and says what to do.
    too_big = rejected(pair(goldenPrompts=golden(64, equals="y" * 5000)))
    assert "use configMapRef" in too_big


def test_the_longest_name_passes_and_names_stay_valid_children() -> None:
    name = "p" * api.MAX_NAME_LENGTH
    spec = parse_pair(pair(name=name))
    ref = builders.PairRef(name, "ns", "uid-1")
    service = builders.service(ref, spec)
    assert service["metadata"]["name"] == name
    assert builders.labels(ref, spec)["app.kubernetes.io/instance"] == name
    config_map = builders.config_map(ref, spec, "0123456789", speculate=True)
    assert len(config_map["metadata"]["name"]) <= 253  # a DNS subdomain
