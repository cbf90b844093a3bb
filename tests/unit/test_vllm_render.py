"""Engine vllm's children (`render.children`), its spec rules and its revision inputs."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from specpair_operator import builders
from specpair_operator.api import DEFAULT_VLLM_IMAGE, SpecError, parse_spec
from specpair_operator.builders import PairRef
from specpair_operator.engines.lws import deployment_view, is_leader
from specpair_operator.headroom import DeviceMemory
from specpair_operator.render import render
from specpair_operator.revision import compute_revision, revision_inputs

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "crds" / "samples"
PAIR = PairRef("llama", "models", "uid-1")
GIB = 1024**3


def sample(name: str) -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load((SAMPLES / name).read_text())["spec"]
    return spec


def rendered(spec: dict[str, Any], device_gib: int | None = 80, per_node: int | None = None) -> Any:
    parsed = parse_spec(spec)
    device = None if device_gib is None else DeviceMemory(device_gib * GIB, "test", cuda=True)
    return render(PAIR, parsed, device, per_node=per_node)


def containers(template: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in template["spec"]["containers"]}


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_the_70b_sample_renders_vllm_with_tensor_parallelism_four() -> None:
    result = rendered(sample("vllm-70b-pair.yaml"))
    assert result.plan.mode == "Colocated"
    config_map, service, workload = result.children
    assert [c["kind"] for c in result.children] == ["ConfigMap", "Service", "Deployment"]
    pod = workload["spec"]["template"]
    assert pod["metadata"]["labels"]["specpair.dev/engine"] == "vllm"
    vllm, gate = containers(pod)["vllm"], containers(pod)["gate"]
    assert vllm["image"] == DEFAULT_VLLM_IMAGE and vllm["command"] == ["vllm", "serve"]
    args = vllm["args"]
    assert args[0] == "meta-llama/Llama-3.1-70B-Instruct"
    assert flag(args, "--revision") == "1605565b47bb9346c5515c34102e054115b4f98b"
    assert flag(args, "--tensor-parallel-size") == "4"
    assert flag(args, "--served-model-name") == "llama"
    assert flag(args, "--max-model-len") == "8192" and flag(args, "--max-num-seqs") == "16"
    assert flag(args, "--gpu-memory-utilization") == "0.9"
    assert "--pipeline-parallel-size" not in args
    config = json.loads(flag(args, "--speculative-config"))
    assert config == {
        "method": "draft_model",
        "model": "meta-llama/Llama-3.2-1B-Instruct",
        "num_speculative_tokens": 4,
        "draft_tensor_parallel_size": 4,
        "revision": "9213176726f574b556790deb65791e0c5aa438b6",
        # disableAboveBatchSize 8 of 16: full depth up to 8 running requests, none above.
        "num_speculative_tokens_per_batch_size": [[1, 8, 4], [9, 16, 0]],
    }
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert {e["name"] for e in vllm["env"]} >= {"HF_TOKEN", "HF_HOME", "VLLM_NO_USAGE_STATS"}
    assert vllm["startupProbe"]["httpGet"]["path"] == "/health"
    # The gate is the pod's readiness, with the runtime's /readyz body.
    assert gate["command"] == ["specpair-runtime"] and gate["args"][0] == "gate"
    assert gate["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "gate"}
    gate_file = yaml.safe_load(config_map["data"]["gate.yaml"])
    assert gate_file["engineUrl"] == "http://127.0.0.1:8000"
    assert gate_file["servedModelName"] == "llama"
    assert gate_file["draft"]["source"] == "hf://meta-llama/Llama-3.2-1B-Instruct"
    assert gate_file["goldenPromptsFile"] == "/etc/specpair/golden.yaml"
    assert "golden.yaml" in config_map["data"]
    assert workload["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert service["spec"]["selector"] == builders.selector_labels(PAIR)


def test_the_405b_sample_renders_a_leader_worker_set_over_two_nodes() -> None:
    result = rendered(sample("vllm-405b-pair.yaml"))
    _, service, workload = result.children
    assert workload["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert workload["kind"] == "LeaderWorkerSet"
    spec = workload["spec"]
    assert spec["leaderWorkerTemplate"]["size"] == 2
    assert spec["rolloutStrategy"]["rollingUpdateConfiguration"]["maxUnavailable"] == 0
    leader = containers(spec["leaderWorkerTemplate"]["leaderTemplate"])
    worker = containers(spec["leaderWorkerTemplate"]["workerTemplate"])
    assert set(leader) == {"vllm", "gate"} and set(worker) == {"vllm"}
    lead, work = leader["vllm"]["args"], worker["vllm"]["args"]
    assert flag(lead, "--tensor-parallel-size") == "16" and flag(lead, "--nnodes") == "2"
    assert flag(lead, "--node-rank") == "0"
    assert flag(lead, "--master-addr") == "$(LWS_LEADER_ADDRESS)"
    assert flag(lead, "--distributed-executor-backend") == "mp"
    assert flag(work, "--node-rank") == "$(LWS_WORKER_INDEX)" and work[-1] == "--headless"
    assert "ports" not in worker["vllm"]
    for pod in (leader, worker):
        assert pod["vllm"]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    # Only the leaders serve the API.
    assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"


def test_gpus_per_node_from_the_nodes_turns_a_deployment_into_a_group() -> None:
    spec = sample("vllm-70b-pair.yaml")
    assert rendered(spec, per_node=2).children[2]["kind"] == "LeaderWorkerSet"
    assert rendered(spec, per_node=8).children[2]["kind"] == "Deployment"


def test_a_pair_that_does_not_fit_renders_nothing() -> None:
    spec = sample("vllm-70b-pair.yaml")
    spec["resources"]["gpus"] = 2
    result = rendered(spec)
    assert result.refused and result.children == ()
    assert "resources.gpus: 4" in result.plan.reason


def test_unknown_memory_renders_with_vllm_defaults() -> None:
    spec = sample("vllm-70b-pair.yaml")
    del spec["resources"]["gpuMemory"]
    result = rendered(spec, device_gib=None)
    args = containers(result.children[2]["spec"]["template"])["vllm"]["args"]
    assert "--gpu-memory-utilization" not in args and "--speculative-config" in args


def test_speculation_off_renders_vllm_without_a_draft() -> None:
    spec = sample("vllm-70b-pair.yaml")
    spec["speculation"] = {"enabled": False}
    result = rendered(spec)
    config_map, _, workload = result.children
    assert "--speculative-config" not in containers(workload["spec"]["template"])["vllm"]["args"]
    assert "draft" not in yaml.safe_load(config_map["data"]["gate.yaml"])


def test_engine_specpair_renders_exactly_the_builders_children() -> None:
    spec = parse_spec(yaml.safe_load((SAMPLES / "gpu-pair.yaml").read_text())["spec"])
    result = render(PAIR, spec, DeviceMemory(80 * GIB, "test", cuda=True))
    assert result.children == (
        builders.config_map(PAIR, spec, result.revision, speculate=True),
        builders.service(PAIR, spec),
        builders.deployment(PAIR, spec, result.revision),
    )
    assert "engine" not in revision_inputs(spec, draft_loaded=True)


def test_a_depth_change_is_a_new_revision_for_vllm_only() -> None:
    vllm = sample("vllm-70b-pair.yaml")
    deeper = copy.deepcopy(vllm)
    deeper["speculation"]["maxDepth"] = 6
    before, after = parse_spec(vllm), parse_spec(deeper)
    assert compute_revision(before, draft_loaded=True) != compute_revision(after, draft_loaded=True)
    own = yaml.safe_load((SAMPLES / "gpu-pair.yaml").read_text())["spec"]
    own_deeper = copy.deepcopy(own)
    own_deeper["speculation"]["maxDepth"] = 6
    assert compute_revision(parse_spec(own), draft_loaded=True) == compute_revision(
        parse_spec(own_deeper), draft_loaded=True
    )


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"engine": "specpair"}, "spec.resources.gpus", "set engine: vllm"),
        ({"resources": {"gpus": 0, "gpuMemory": None}}, "vllm.image", "CPU build of vLLM"),
        ({"target": {"ggufFile": "m.gguf"}}, "target.source", "not a GGUF file"),
        ({"draft": {"quantization": "int4-weight"}}, "draft.quantization", "quantized checkpoint"),
        ({"draft": {"dtype": "float16"}}, "draft.dtype", "the target's dtype"),
        ({"speculation": {"acceptanceFloor": 0.3}}, "speculation.acceptanceFloor", "no such"),
        ({"vllm": {"extraArgs": ["--tensor-parallel-size=2"]}}, "extraArgs", "set by the operator"),
        ({"engine": "specpair", "resources": {"gpus": 1, "gpusPerNode": 8}}, "gpusPerNode", "vllm"),
    ],
)
def test_what_vllm_cannot_serve_is_refused_naming_the_field(
    change: dict[str, Any], field: str, words: str
) -> None:
    spec = sample("vllm-70b-pair.yaml")
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {k: v for k, v in {**spec[key], **value}.items() if v is not None}
        else:
            spec[key] = value
    with pytest.raises(SpecError) as raised:
        parse_spec(spec)
    assert field in str(raised.value) and words in str(raised.value)


def test_a_leader_worker_set_reads_as_a_deployment_for_the_status() -> None:
    workload = rendered(sample("vllm-405b-pair.yaml")).children[2]
    live = {
        **workload,
        "metadata": {**workload["metadata"], "generation": 2},
        "status": {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1},
    }
    view = deployment_view(live)
    labels = view["spec"]["template"]["metadata"]["labels"]
    assert (
        labels["specpair.dev/revision"] == workload["metadata"]["labels"]["specpair.dev/revision"]
    )
    assert view["status"]["availableReplicas"] == 1
    assert view["status"]["observedGeneration"] == 2
    assert is_leader({"metadata": {"labels": {"leaderworkerset.sigs.k8s.io/worker-index": "0"}}})
    assert not is_leader(
        {"metadata": {"labels": {"leaderworkerset.sigs.k8s.io/worker-index": "1"}}}
    )
