"""Engine vllm: the pair's children when vLLM's own OpenAI server serves it (pure).

One pod (or, past one node, one LeaderWorkerSet group, `lws.py`) holds:

- container ``vllm``: ``vllm serve`` with the target, the draft in
  ``--speculative-config``, tensor parallelism over the pair's GPUs and the
  lengths and memory of the plan (`vllm_args.py`);
- container ``gate``: ``specpair-runtime gate`` from the specpair runtime
  image. It checks the pair's alignment from the model files, then runs the
  golden prompts through vLLM's OpenAI API on localhost, and its ``/readyz``
  is the pod's readiness (vLLM's own is ``/health``). A failed check keeps
  the pod unready with the runtime's ``phase: failed`` body, so the operator
  rolls the revision back exactly as it does for its own engine.

Children: ConfigMap ``<name>-<revision>`` (``gate.yaml``, inline
``golden.yaml``), the Service, and the workload (a Deployment on one node).
vLLM takes no setting live, so everything it reads is in the revision hash
(`revision.py`): a depth change is a versioned rollout, gated like any other.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from specpair_operator import builders
from specpair_operator.api import DEFAULT_VLLM_IMAGE, SpeculativePairSpec
from specpair_operator.builders import (
    CONFIG_DIR,
    MODEL_CACHE_DIR,
    PORT_NAME,
    REVISION_LABEL,
    RUNTIME_UID,
    TERMINATION_MESSAGE_PATH,
    Manifest,
    PairRef,
)
from specpair_operator.engines import ENGINE_LABEL
from specpair_operator.engines.vllm_args import Layout, serve_args
from specpair_runtime.config import GateConfig, ModelSpec, PairInfo, dump_gate_config

VLLM_CONTAINER = "vllm"
GATE_CONTAINER = "gate"
GATE_PORT_NAME = "gate"
GATE_FILE = f"{CONFIG_DIR}/gate.yaml"
API_KEY_ENV = "VLLM_API_KEY"  # vLLM's own variable for its --api-key
SHM_SIZE = "16Gi"  # vLLM's workers exchange tensors through /dev/shm
GATE_RESOURCES = {"cpu": "1", "memory": "2Gi"}
PROBE_PERIOD_SECONDS = builders.PROBE_PERIOD_SECONDS


def gate_port(spec: SpeculativePairSpec) -> int:
    port = spec.serving.port
    return port + 1 if port < 65535 else port - 1


def image(spec: SpeculativePairSpec) -> str:
    chosen = spec.vllm.image if spec.vllm is not None else None
    return chosen or DEFAULT_VLLM_IMAGE


def pod_labels(pair: PairRef, spec: SpeculativePairSpec, revision: str) -> dict[str, str]:
    return {**builders.labels(pair, spec), REVISION_LABEL: revision, ENGINE_LABEL: "vllm"}


def gate_config(pair: PairRef, spec: SpeculativePairSpec, *, speculate: bool) -> GateConfig:
    def model(which: str) -> ModelSpec:
        return ModelSpec.model_validate(getattr(spec, which).model_dump(exclude={"size"}))

    return GateConfig(
        pair=PairInfo(name=pair.name, version=spec.version),
        engine_url=f"http://127.0.0.1:{spec.serving.port}",
        served_model_name=pair.name,
        target=model("target"),
        draft=model("draft") if speculate else None,
        golden_prompts_file=builders.golden_file(spec),
        port=gate_port(spec),
        cuda=spec.resources.gpus > 0,
        engine_start_timeout_seconds=float(spec.rollout.startup_timeout_seconds),
        api_key_env=API_KEY_ENV if spec.serving.api_key_secret is not None else None,
    )


# A LeaderWorkerSet keeps no pod template per revision the operator could read back (a
# Deployment keeps one in each ReplicaSet), so its revision's ConfigMap carries it.
GROUP_TEMPLATE_KEY = "leaderworkerset-template.json"


def config_map(
    pair: PairRef,
    spec: SpeculativePairSpec,
    revision: str,
    *,
    speculate: bool,
    group_template: dict[str, Any] | None = None,
) -> Manifest:
    data = {"gate.yaml": dump_gate_config(gate_config(pair, spec, speculate=speculate))}
    golden = spec.golden_prompts
    if golden is not None and golden.inline is not None:
        data["golden.yaml"] = builders.inline_golden_file(golden)
    if group_template is not None:
        data[GROUP_TEMPLATE_KEY] = json.dumps(group_template, sort_keys=True)
    meta = builders._metadata(
        pair, spec, builders.config_map_name(pair, revision), {REVISION_LABEL: revision}
    )
    return builders._stamped(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}
    )


def service(pair: PairRef, spec: SpeculativePairSpec, shape: Layout) -> Manifest:
    """The specpair Service; past one node it selects the group leaders only."""
    manifest = copy.deepcopy(builders.service(pair, spec))
    if shape.multi_node:
        manifest["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] = "0"
        manifest["metadata"]["annotations"].pop(builders.HASH_ANNOTATION, None)
        manifest = builders._stamped(manifest)
    return manifest


def _volumes(
    pair: PairRef, spec: SpeculativePairSpec, revision: str, *, leader: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(pod volumes, vLLM's mounts, the gate's mounts)."""
    volumes, mounts = builders._volumes(pair, spec, revision)
    # vLLM never reads the API-key file (it gets the key through its environment).
    vllm_mounts = [m for m in mounts if m["name"] not in ("config", "golden", "api-key")]
    volumes = [v for v in volumes if v["name"] != "api-key"]
    gate_mounts = [m for m in mounts if m["name"] != "api-key"]
    volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}})
    vllm_mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if not leader:
        volumes = [v for v in volumes if v["name"] not in ("config", "golden")]
        gate_mounts = []
    return volumes, vllm_mounts, gate_mounts


def _secret_env(name: str, secret: Any) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}}}


def _env(spec: SpeculativePairSpec, shape: Layout, *, gate: bool) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": f"{MODEL_CACHE_DIR}/hf"},
    ]
    if not gate:
        env += [
            {"name": "VLLM_CACHE_ROOT", "value": f"{MODEL_CACHE_DIR}/vllm"},
            {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
            {"name": "DO_NOT_TRACK", "value": "1"},
        ]
        if shape.cpu_kv_cache_gib is not None:
            env.append({"name": "VLLM_CPU_KVCACHE_SPACE", "value": str(shape.cpu_kv_cache_gib)})
    else:
        env.append({"name": "OMP_WAIT_POLICY", "value": "PASSIVE"})
    if spec.hf_token_secret is not None:
        env.append(_secret_env("HF_TOKEN", spec.hf_token_secret))
    if spec.serving.api_key_secret is not None:
        env.append(_secret_env(API_KEY_ENV, spec.serving.api_key_secret))
    return env


def _probe(path: str, port: str, *, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUNTIME_UID,
        "runAsGroup": RUNTIME_UID,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def vllm_container(
    spec: SpeculativePairSpec, shape: Layout, args: list[str], mounts: list[dict[str, Any]]
) -> dict[str, Any]:
    startup = max(1, -(-spec.rollout.startup_timeout_seconds // PROBE_PERIOD_SECONDS))
    headless = "--headless" in args
    container: dict[str, Any] = {
        "name": VLLM_CONTAINER,
        "image": image(spec),
        "imagePullPolicy": "IfNotPresent",
        "command": ["vllm", "serve"],
        "args": args,
        "env": _env(spec, shape, gate=False),
        "resources": builders.container_resources(
            spec, shape.gpus_per_pod if spec.resources.gpus > 0 else 0
        ),
        "volumeMounts": mounts,
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _security(),
    }
    if not headless:
        container["ports"] = [
            {"name": PORT_NAME, "containerPort": spec.serving.port, "protocol": "TCP"}
        ]
        # Loading a large target takes minutes; the startupProbe holds liveness off.
        container["startupProbe"] = _probe(
            "/health", PORT_NAME, period=PROBE_PERIOD_SECONDS, failures=startup
        )
        container["livenessProbe"] = _probe(
            "/health", PORT_NAME, period=PROBE_PERIOD_SECONDS, failures=3
        )
    return container


def gate_container(
    spec: SpeculativePairSpec, shape: Layout, mounts: list[dict[str, Any]]
) -> dict[str, Any]:
    amounts = dict(GATE_RESOURCES)
    return {
        "name": GATE_CONTAINER,
        "image": spec.runtime_image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["specpair-runtime"],
        "args": ["gate", "--config", GATE_FILE],
        "ports": [{"name": GATE_PORT_NAME, "containerPort": gate_port(spec), "protocol": "TCP"}],
        "env": _env(spec, shape, gate=True),
        "resources": {"requests": dict(amounts), "limits": dict(amounts)},
        "volumeMounts": mounts,
        # The pod is ready when the pair's checks passed and vLLM answers (the gate asks it).
        "readinessProbe": _probe("/readyz", GATE_PORT_NAME, period=5, failures=3),
        "livenessProbe": _probe(
            "/healthz", GATE_PORT_NAME, period=PROBE_PERIOD_SECONDS, failures=3
        ),
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _security(),
    }


def pod_template(
    pair: PairRef,
    spec: SpeculativePairSpec,
    revision: str,
    shape: Layout,
    args: list[str],
    *,
    leader: bool = True,
) -> dict[str, Any]:
    """One pod of the pair: vLLM and, on the leader, the gate."""
    volumes, vllm_mounts, gate_mounts = _volumes(pair, spec, revision, leader=leader)
    containers = [vllm_container(spec, shape, args, vllm_mounts)]
    if leader:
        containers.append(gate_container(spec, shape, gate_mounts))
    pod_spec = builders.runtime_pod_spec(spec, containers, volumes)
    return {
        "metadata": {
            "labels": pod_labels(pair, spec, revision),
            "annotations": {REVISION_LABEL: revision},
        },
        "spec": pod_spec,
    }


def deployment(
    pair: PairRef, spec: SpeculativePairSpec, revision: str, shape: Layout, *, speculate: bool
) -> Manifest:
    """The Deployment of a pair on one node; the old revision serves until the gate passes."""
    args = serve_args(pair.name, spec, shape, speculate=speculate)
    template = pod_template(pair, spec, revision, shape, args)
    meta = builders._metadata(pair, spec, pair.name, {REVISION_LABEL: revision})
    return builders._stamped(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": meta,
            "spec": {
                "replicas": spec.replicas,
                "revisionHistoryLimit": 5,
                "progressDeadlineSeconds": spec.rollout.progress_deadline_seconds,
                "selector": {"matchLabels": builders.selector_labels(pair)},
                "strategy": {
                    "type": "RollingUpdate",
                    "rollingUpdate": {"maxUnavailable": 0, "maxSurge": spec.rollout.max_surge},
                },
                "template": template,
            },
        }
    )
