"""The pure manifest builders: names, owners, labels, probes, resources, security."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from specpair_operator import api, builders
from specpair_operator.api import SpeculativePairSpec, parse_spec
from specpair_operator.builders import PairRef
from specpair_runtime.config import (
    OutputFilter,
    RuntimeConfig,
    ServingOptions,
    parse_runtime_config,
)
from specpair_runtime.golden import parse_golden

ROOT = Path(__file__).resolve().parents[2]
PAIR = PairRef(name="llama", namespace="serving", uid="0b6f9a52-0000-4000-8000-000000000001")
REV = "abcdef0123"


def sample_spec(name: str = "gpu-pair.yaml", **changes: Any) -> SpeculativePairSpec:
    data = yaml.safe_load((ROOT / "crds" / "samples" / name).read_text())["spec"]
    data.update(changes)
    return parse_spec(data)


def test_config_map_holds_a_valid_runtime_config() -> None:
    spec = sample_spec()
    cm = builders.config_map(PAIR, spec, REV, speculate=True)
    assert cm["metadata"]["name"] == f"llama-{REV}"
    config = parse_runtime_config(yaml.safe_load(cm["data"]["runtime.yaml"]))
    assert config.pair.name == "llama" and config.pair.version == "2024-07-a"
    assert config.target.source == "hf://meta-llama/Llama-3.1-8B-Instruct"
    assert config.draft.revision == "9213176726f574b556790deb65791e0c5aa438b6"
    assert config.speculation == spec.speculation
    assert config.serving.port == 8000 and config.serving.max_model_length == 4096
    assert config.serving.api_key_file == "/etc/specpair-secrets/api-key"
    assert config.serving.golden_prompts_file == "/etc/specpair/golden.yaml"
    golden = parse_golden(yaml.safe_load(cm["data"]["golden.yaml"]))
    assert [p.name for p in golden.prompts] == ["capital"]


def test_target_only_renders_speculation_off() -> None:
    spec = sample_spec()
    cm = builders.config_map(PAIR, spec, REV, speculate=False)
    config = parse_runtime_config(yaml.safe_load(cm["data"]["runtime.yaml"]))
    assert config.speculation.enabled is False
    assert config.speculation.max_depth == spec.speculation.max_depth


def test_children_are_owned_and_labelled() -> None:
    spec = sample_spec()
    for child in (
        builders.config_map(PAIR, spec, REV, speculate=True),
        builders.deployment(PAIR, spec, REV),
        builders.service(PAIR, spec),
    ):
        meta = child["metadata"]
        assert meta["namespace"] == "serving"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "specpair.dev/v1alpha1",
                "kind": "SpeculativePair",
                "name": "llama",
                "uid": PAIR.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert meta["labels"]["app.kubernetes.io/instance"] == "llama"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "specpair-operator"
        assert meta["labels"]["app.kubernetes.io/version"] == "2024-07-a"
        assert meta["annotations"][builders.HASH_ANNOTATION]


def test_deployment_pod_template() -> None:
    spec = sample_spec()
    dep = builders.deployment(PAIR, spec, REV)
    assert dep["metadata"]["name"] == "llama"
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    template = dep["spec"]["template"]
    assert template["metadata"]["labels"]["specpair.dev/revision"] == REV
    # The selector must not carry the revision or version: it is immutable.
    assert dep["spec"]["selector"]["matchLabels"] == builders.selector_labels(PAIR)
    pod = template["spec"]
    assert len(pod["containers"]) == 1
    ctr = pod["containers"][0]
    assert ctr["command"] + ctr["args"] == [
        "specpair-runtime",
        "serve",
        "--config",
        "/etc/specpair/runtime.yaml",
    ]
    assert ctr["resources"]["limits"] == {"cpu": "8", "memory": "48Gi", "nvidia.com/gpu": "1"}
    assert ctr["resources"]["requests"] == ctr["resources"]["limits"]
    assert ctr["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert ctr["livenessProbe"]["httpGet"]["path"] == "/healthz"
    startup = ctr["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800
    sc = ctr["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    mounts = {m["mountPath"]: m for m in ctr["volumeMounts"]}
    assert {"/tmp", "/var/cache/specpair", "/etc/specpair", "/etc/specpair-secrets"} <= set(mounts)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["config"]["configMap"]["name"] == f"llama-{REV}"
    assert "emptyDir" in volumes["tmp"] and "emptyDir" in volumes["model-cache"]
    env = {e["name"]: e for e in ctr["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"


def test_pvc_sources_are_mounted_read_only() -> None:
    spec = sample_spec(
        target={
            "source": "pvc://models/llama-8b",
            "size": {"parameters": 8, "layers": 1, "kvHeads": 1, "headDim": 1},
        },
        draft={
            "source": "pvc://models/llama-1b",
            "size": {"parameters": 1, "layers": 1, "kvHeads": 1, "headDim": 1},
        },
    )
    pod = builders.deployment(PAIR, spec, REV)["spec"]["template"]["spec"]
    claims = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert claims == [
        {"name": "models-0", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}}
    ]
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "models-0")
    assert mount == {"name": "models-0", "mountPath": "/models/models", "readOnly": True}


def test_golden_config_map_ref_is_mounted() -> None:
    spec = sample_spec(goldenPrompts={"configMapRef": {"name": "golden", "key": "prompts.yaml"}})
    cm = builders.config_map(PAIR, spec, REV, speculate=True)
    assert "golden.yaml" not in cm["data"]
    config = parse_runtime_config(yaml.safe_load(cm["data"]["runtime.yaml"]))
    assert config.serving.golden_prompts_file == "/etc/specpair-golden/golden.yaml"
    pod = builders.deployment(PAIR, spec, REV)["spec"]["template"]["spec"]
    golden = next(v for v in pod["volumes"] if v["name"] == "golden")
    assert golden["configMap"]["items"] == [{"key": "prompts.yaml", "path": "golden.yaml"}]


def test_cpu_pair_has_no_gpu_resources() -> None:
    spec = sample_spec("cpu-pair.yaml")
    ctr = builders.deployment(PAIR, spec, REV)["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in ctr["resources"]["limits"]


def test_service_selects_the_pods() -> None:
    spec = sample_spec()
    svc = builders.service(PAIR, spec)
    assert svc["metadata"]["name"] == "llama"
    assert svc["spec"]["selector"] == builders.selector_labels(PAIR)
    assert svc["spec"]["ports"][0]["port"] == 8000
    assert svc["spec"]["ports"][0]["targetPort"] == "http"


def test_scale_selector_selects_the_deployments_pods() -> None:
    """status.selector (the scale subresource's) is the Deployment's selector as a string."""
    dep = builders.deployment(PAIR, sample_spec(), "r1")
    selector = builders.selector_string(PAIR)
    assert selector == "app.kubernetes.io/instance=llama,app.kubernetes.io/name=specpair"
    wanted = dict(part.split("=") for part in selector.split(","))
    assert wanted == dep["spec"]["selector"]["matchLabels"]
    assert wanted.items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_builders_are_deterministic_and_hash_tracks_content() -> None:
    spec = sample_spec()
    assert builders.deployment(PAIR, spec, REV) == builders.deployment(PAIR, spec, REV)
    scaled = spec.model_copy(update={"replicas": 3})
    a = builders.deployment(PAIR, spec, REV)["metadata"]["annotations"]
    b = builders.deployment(PAIR, scaled, REV)["metadata"]["annotations"]
    assert a[builders.HASH_ANNOTATION] != b[builders.HASH_ANNOTATION]


@pytest.mark.parametrize("sample", ["gpu-pair.yaml", "cpu-pair.yaml"])
def test_manifests_validate_against_kubernetes_schemas(sample: str) -> None:
    spec = sample_spec(sample)
    for child in (
        builders.config_map(PAIR, spec, REV, speculate=True),
        builders.deployment(PAIR, spec, REV),
        builders.service(PAIR, spec),
    ):
        kubernetes_validate.validate(child, "1.27.0", strict=True)


def test_knobs_in_force_match_the_config_map_and_turn_off_for_target_only() -> None:
    spec = sample_spec()
    manifest = builders.config_map(PAIR, spec, REV, speculate=True)
    rendered = yaml.safe_load(manifest["data"]["runtime.yaml"])
    assert builders.knobs_in_force(spec, speculate=True) == rendered["speculation"]
    off = builders.knobs_in_force(spec, speculate=False)
    assert off["enabled"] is False and off["maxDepth"] == spec.speculation.max_depth


SERVING_OPTIONS: dict[str, Any] = {
    "port": 8000,
    "maxBatchSize": 8,
    "maxModelLength": 4096,
    "maxStepTokens": 128,
    "cudaGraphs": False,
    "cudaGraphCompile": True,
    "prefillOrder": "arrival",
    "prefixReuse": False,
    "cpuThreads": 1,
    "maxRequestBodyBytes": 65536,
    "headerTimeoutSeconds": 2.5,
    "bodyTimeoutSeconds": 12,
    "drainTimeoutSeconds": 60.5,
    "outputFilter": {"denyPatterns": ["(?i)secret"]},
}


def rendered_config(spec: SpeculativePairSpec) -> RuntimeConfig:
    cm = builders.config_map(PAIR, spec, REV, speculate=True)
    return parse_runtime_config(yaml.safe_load(cm["data"]["runtime.yaml"]))


def test_serving_options_reach_the_runtime_config() -> None:
    spec = sample_spec(serving=SERVING_OPTIONS)
    serving = rendered_config(spec).serving
    assert serving.max_step_tokens == 128
    assert serving.cuda_graphs is False
    assert serving.cuda_graph_compile is True
    assert serving.prefill_order == "arrival"
    assert serving.prefix_reuse is False
    assert serving.cpu_threads == 1
    assert serving.max_request_body_bytes == 65536 and serving.request_body_limit == 65536
    assert serving.header_timeout_seconds == 2.5
    assert serving.body_timeout_seconds == 12.0
    assert serving.drain_timeout_seconds == 60.5
    assert serving.output_filter == OutputFilter(deny_patterns=["(?i)secret"])
    assert serving.host == "0.0.0.0"  # set by the builder: the spec has no host
    pod = builders.deployment(PAIR, spec, REV)["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 61 + api.SHUTDOWN_SLACK_SECONDS


def test_unset_serving_options_keep_the_runtime_defaults() -> None:
    spec = sample_spec()
    cm = builders.config_map(PAIR, spec, REV, speculate=True)
    defaults = ServingOptions()
    serving = rendered_config(spec).serving
    for name in api.RUNTIME_SERVING_OPTIONS:
        assert getattr(serving, name) == getattr(defaults, name), name
    pod = builders.deployment(PAIR, spec, REV)["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 45  # the default 30 s drain + 15
    # Before SIGTERM, a pause for the endpoints to drop the pod, within the slack.
    (container,) = pod["containers"]
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop == ["sleep", str(builders.ENDPOINT_GRACE_SECONDS)]
    assert builders.ENDPOINT_GRACE_SECONDS < api.SHUTDOWN_SLACK_SECONDS
    assert "nearTieMargin" not in yaml.safe_load(cm["data"]["golden.yaml"])


def test_the_crd_carries_every_runtime_serving_option() -> None:
    # The builder sets these itself: the bind address and the paths of mounted files.
    set_by_the_builder = {"host", "api_key_file", "golden_prompts_file"}
    from_the_spec = set(api.ServingSpec.model_fields) - {"api_key_secret"}
    assert set(ServingOptions.model_fields) - set_by_the_builder == from_the_spec


def test_inline_near_tie_margin_reaches_the_golden_file() -> None:
    golden = {"inline": [{"name": "capital", "prompt": "The capital of France is"}]}
    spec = sample_spec(goldenPrompts={**golden, "nearTieMargin": 0.25})
    cm = builders.config_map(PAIR, spec, REV, speculate=True)
    parsed = parse_golden(yaml.safe_load(cm["data"]["golden.yaml"]))
    assert parsed.near_tie_margin == 0.25
    assert [p.name for p in parsed.prompts] == ["capital"]


def test_largest_serving_options_make_valid_manifests() -> None:
    serving = {
        **SERVING_OPTIONS,
        "maxStepTokens": 1048576,
        "maxRequestBodyBytes": api.MAX_REQUEST_BODY_BYTES,
        "headerTimeoutSeconds": api.MAX_SERVING_TIMEOUT_SECONDS,
        "bodyTimeoutSeconds": api.MAX_SERVING_TIMEOUT_SECONDS,
        "drainTimeoutSeconds": api.MAX_SERVING_TIMEOUT_SECONDS,
        "outputFilter": {"denyPatterns": ["x" * api.MAX_DENY_PATTERN_LENGTH] * 64},
    }
    spec = sample_spec(serving=serving)
    assert rendered_config(spec).serving.max_step_tokens == 1048576
    for child in (
        builders.config_map(PAIR, spec, REV, speculate=True),
        builders.deployment(PAIR, spec, REV),
    ):
        kubernetes_validate.validate(child, "1.27.0", strict=True)
