"""Pure builders: a SpeculativePair (plus its plan and revision) → child manifests.

Nothing here talks to the API server. Each builder returns a plain dict ready
for a create/replace call; `reconcile.apply_child` decides whether to write it
(it compares the fields the operator owns with the live child, `drift.py`).

Children of pair ``<name>``:

- ConfigMap ``<name>-<revision>``: ``runtime.yaml`` (and the inline
  ``golden.yaml``). Everything in it that needs a restart is in the revision
  hash, so that part never changes under a running pod: a new revision gets
  a new ConfigMap, and the old one stays for a rollback. Only the live
  ``speculation`` section is rewritten in place; the runtime polls the file
  (a directory mount, which the kubelet refreshes) and applies the knobs
  without a restart. That is why it is not marked ``immutable``.
- Deployment ``<name>``: one runtime container holding both models.
- Service ``<name>``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

import yaml

from specpair_operator import api
from specpair_operator.api import GoldenPromptsSpec, SpeculativePairSpec
from specpair_runtime.config import (
    ModelSpec,
    PairInfo,
    RuntimeConfig,
    ServingOptions,
    SpeculationKnobs,
    dump_runtime_config,
)

Manifest = dict[str, Any]

CONFIG_DIR = "/etc/specpair"
CONFIG_FILE = f"{CONFIG_DIR}/runtime.yaml"
INLINE_GOLDEN_FILE = f"{CONFIG_DIR}/golden.yaml"
# Not nested under CONFIG_DIR: a read-only ConfigMap volume cannot hold mount points.
REF_GOLDEN_DIR = "/etc/specpair-golden"
API_KEY_DIR = "/etc/specpair-secrets"
MODEL_CACHE_DIR = "/var/cache/specpair"
MODELS_DIR = "/models"  # pvc://claim/path is read from /models/<claim>/<path>
CONTAINER_NAME = "runtime"
PORT_NAME = "http"
RUNTIME_UID = 65532  # "nonroot" in distroless images
PROBE_PERIOD_SECONDS = 10
TERMINATION_MESSAGE_PATH = "/dev/termination-log"  # the runtime's default, and Kubernetes'
# A deleted pod leaves its Service's endpoints while the kubelet stops it, and
# kube-proxy takes a moment to follow. Until then new requests still arrive,
# and a runtime that had begun its drain would refuse them (503). So the pod
# keeps serving this long before SIGTERM (a preStop hook; it counts against
# the grace period's slack, api.SHUTDOWN_SLACK_SECONDS).
ENDPOINT_GRACE_SECONDS = 5

REVISION_LABEL = "specpair.dev/revision"
HASH_ANNOTATION = "specpair.dev/applied-hash"
MANAGED_BY = "specpair-operator"


@dataclass(frozen=True)
class PairRef:
    """What the builders need of the pair object's metadata."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> PairRef:
        meta = body["metadata"]
        return cls(meta["name"], meta["namespace"], meta["uid"])


def config_map_name(pair: PairRef, revision: str) -> str:
    return f"{pair.name}-{revision}"


def selector_labels(pair: PairRef) -> dict[str, str]:
    """The Deployment's selector and the Service's: stable across revisions."""
    return {"app.kubernetes.io/name": "specpair", "app.kubernetes.io/instance": pair.name}


def selector_string(pair: PairRef) -> str:
    """`selector_labels` as a label selector string (the scale subresource's selector)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(pair).items()))


def labels(pair: PairRef, spec: SpeculativePairSpec) -> dict[str, str]:
    return {
        **selector_labels(pair),
        "app.kubernetes.io/version": spec.version,
        "app.kubernetes.io/component": "runtime",
        "app.kubernetes.io/part-of": "specpair",
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


def owner_reference(pair: PairRef) -> dict[str, Any]:
    return {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "name": pair.name,
        "uid": pair.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def content_hash(manifest: Manifest) -> str:
    """Hash of what the operator wants; stored on the child to skip no-op writes."""
    canonical = json.dumps(manifest, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _metadata(
    pair: PairRef, spec: SpeculativePairSpec, name: str, extra_labels: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": pair.namespace,
        "labels": {**labels(pair, spec), **(extra_labels or {})},
        "ownerReferences": [owner_reference(pair)],
    }


def _stamped(manifest: Manifest) -> Manifest:
    """Add the content hash annotation (computed without it)."""
    digest = content_hash(manifest)
    manifest["metadata"].setdefault("annotations", {})[HASH_ANNOTATION] = digest
    return manifest


def golden_file(spec: SpeculativePairSpec) -> str | None:
    """Where the runtime finds the golden prompts, if any."""
    golden = spec.golden_prompts
    if golden is None:
        return None
    return INLINE_GOLDEN_FILE if golden.inline is not None else f"{REF_GOLDEN_DIR}/golden.yaml"


def _knobs(spec: SpeculativePairSpec, *, speculate: bool) -> SpeculationKnobs:
    if speculate:
        return spec.speculation
    return spec.speculation.model_copy(update={"enabled": False})


def runtime_config(pair: PairRef, spec: SpeculativePairSpec, *, speculate: bool) -> RuntimeConfig:
    """The runtime config file's content; ``speculate=False`` when the draft does not fit."""
    knobs = _knobs(spec, speculate=speculate)
    api_key = spec.serving.api_key_secret
    return RuntimeConfig(
        pair=PairInfo(name=pair.name, version=spec.version),
        target=ModelSpec.model_validate(spec.target.model_dump(exclude={"size"})),
        draft=ModelSpec.model_validate(spec.draft.model_dump(exclude={"size"})),
        speculation=knobs,
        serving=ServingOptions(
            # In a pod the Service reaches the container on its pod IP.
            host="0.0.0.0",
            port=spec.serving.port,
            max_batch_size=spec.serving.max_batch_size,
            max_model_length=spec.serving.max_model_length,
            max_waiting_requests=spec.serving.max_waiting_requests,
            api_key_file=None if api_key is None else f"{API_KEY_DIR}/{api_key.key}",
            golden_prompts_file=golden_file(spec),
            **spec.serving.runtime_options(),
        ),
    )


def knobs_in_force(spec: SpeculativePairSpec, *, speculate: bool) -> dict[str, object]:
    """The speculation section as the runtime config carries it (for the status)."""
    return _knobs(spec, speculate=speculate).model_dump(
        by_alias=True, mode="json", exclude_none=True
    )


def inline_golden_file(golden: GoldenPromptsSpec) -> str:
    """The golden-prompt file of inline prompts (the runtime's `GoldenFile` format)."""
    document: dict[str, object] = {"prompts": [p.to_wire() for p in golden.inline or []]}
    if golden.near_tie_margin is not None:
        document["nearTieMargin"] = golden.near_tie_margin
    return yaml.safe_dump(document, sort_keys=False)


def termination_grace_seconds(spec: SpeculativePairSpec) -> int:
    """The pod's grace period: the runtime's drain, then time to stop the engine and exit."""
    drain = spec.serving.drain_timeout_seconds or ServingOptions().drain_timeout_seconds
    return math.ceil(drain) + api.SHUTDOWN_SLACK_SECONDS


def config_map(
    pair: PairRef, spec: SpeculativePairSpec, revision: str, *, speculate: bool
) -> Manifest:
    """The per-revision ConfigMap of the runtime config (and inline golden prompts)."""
    data = {"runtime.yaml": dump_runtime_config(runtime_config(pair, spec, speculate=speculate))}
    golden = spec.golden_prompts
    if golden is not None and golden.inline is not None:
        data["golden.yaml"] = inline_golden_file(golden)
    return _stamped(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _metadata(
                pair, spec, config_map_name(pair, revision), {REVISION_LABEL: revision}
            ),
            "data": data,
        }
    )


def container_resources(spec: SpeculativePairSpec, gpus_per_pod: int) -> dict[str, Any]:
    """The container's requests and limits: the pair's CPU and memory, and its GPUs per pod."""
    amounts: dict[str, str] = {}
    res = spec.resources
    if res.cpu is not None:
        amounts["cpu"] = res.cpu
    if res.memory is not None:
        amounts["memory"] = res.memory
    if gpus_per_pod > 0:
        amounts["nvidia.com/gpu"] = str(gpus_per_pod)
    # Requests equal limits: a pair is latency-bound and must not be overcommitted.
    return {"requests": dict(amounts), "limits": dict(amounts)} if amounts else {}


def _pvc_claims(spec: SpeculativePairSpec) -> list[str]:
    claims: list[str] = []
    for model in (spec.target, spec.draft):
        if model.source.startswith("pvc://"):
            claim = model.source.removeprefix("pvc://").split("/", 1)[0]
            if claim and claim not in claims:
                claims.append(claim)
    return claims


def _volumes(
    pair: PairRef, spec: SpeculativePairSpec, revision: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": config_map_name(pair, revision)}},
        {"name": "tmp", "emptyDir": {}},
        {"name": "model-cache", "emptyDir": {}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "model-cache", "mountPath": MODEL_CACHE_DIR},
    ]
    golden = spec.golden_prompts
    if golden is not None and golden.config_map_ref is not None:
        ref = golden.config_map_ref
        volumes.append(
            {
                "name": "golden",
                "configMap": {"name": ref.name, "items": [{"key": ref.key, "path": "golden.yaml"}]},
            }
        )
        mounts.append({"name": "golden", "mountPath": REF_GOLDEN_DIR, "readOnly": True})
    secret = spec.serving.api_key_secret
    if secret is not None:
        volumes.append(
            {
                "name": "api-key",
                "secret": {
                    "secretName": secret.name,
                    "items": [{"key": secret.key, "path": secret.key}],
                },
            }
        )
        mounts.append({"name": "api-key", "mountPath": API_KEY_DIR, "readOnly": True})
    for index, claim in enumerate(_pvc_claims(spec)):
        volume = f"models-{index}"
        volumes.append(
            {"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        )
        mounts.append({"name": volume, "mountPath": f"{MODELS_DIR}/{claim}", "readOnly": True})
    return volumes, mounts


def _env(spec: SpeculativePairSpec) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "HF_HOME", "value": f"{MODEL_CACHE_DIR}/hf"},
        {"name": "OMP_WAIT_POLICY", "value": "PASSIVE"},
    ]
    token = spec.hf_token_secret
    if token is not None:
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}},
            }
        )
    return env


def _probe(path: str, *, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def container(spec: SpeculativePairSpec, mounts: list[dict[str, Any]]) -> dict[str, Any]:
    startup_failures = max(1, -(-spec.rollout.startup_timeout_seconds // PROBE_PERIOD_SECONDS))
    return {
        "name": CONTAINER_NAME,
        "image": spec.runtime_image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["specpair-runtime"],
        "args": ["serve", "--config", CONFIG_FILE],
        "ports": [{"name": PORT_NAME, "containerPort": spec.serving.port, "protocol": "TCP"}],
        "env": _env(spec),
        "resources": container_resources(spec, spec.resources.gpus),
        "volumeMounts": mounts,
        # Loading both models (and the golden prompts) can take minutes; the
        # startupProbe holds liveness off until then.
        "startupProbe": _probe("/healthz", period=PROBE_PERIOD_SECONDS, failures=startup_failures),
        "readinessProbe": _probe("/readyz", period=5, failures=3),
        "livenessProbe": _probe("/healthz", period=PROBE_PERIOD_SECONDS, failures=3),
        # `serve` writes why it could not start to this file (specpair_runtime.termination);
        # the log tail stands in when it died before it could. The operator rolls a
        # revision back as soon as a pod of it terminates with a message.
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        # The image's `sleep` (coreutils; both runtime images have it).
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(ENDPOINT_GRACE_SECONDS)]}}},
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUNTIME_UID,
            "runAsGroup": RUNTIME_UID,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }


def runtime_pod_spec(
    spec: SpeculativePairSpec, containers: list[dict[str, Any]], volumes: list[dict[str, Any]]
) -> dict[str, Any]:
    """A runtime pod's spec: non-root, no service-account token, the pair's scheduling."""
    pod_spec: dict[str, Any] = {
        "containers": containers,
        "volumes": volumes,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # The runtime drains in-flight requests on SIGTERM (serving.drainTimeoutSeconds).
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUNTIME_UID,
            "runAsGroup": RUNTIME_UID,
            "fsGroup": RUNTIME_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    scheduling = spec.scheduling
    if scheduling.node_selector:
        pod_spec["nodeSelector"] = dict(scheduling.node_selector)
    if scheduling.tolerations:
        pod_spec["tolerations"] = [t.to_wire() for t in scheduling.tolerations]
    if scheduling.affinity:
        pod_spec["affinity"] = scheduling.affinity
    return pod_spec


def deployment(pair: PairRef, spec: SpeculativePairSpec, revision: str) -> Manifest:
    """The Deployment; its pod template carries the revision, so a new one rolls out."""
    volumes, mounts = _volumes(pair, spec, revision)
    pod_labels = {**labels(pair, spec), REVISION_LABEL: revision}
    pod_spec = runtime_pod_spec(spec, [container(spec, mounts)], volumes)
    return _stamped(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": _metadata(pair, spec, pair.name, {REVISION_LABEL: revision}),
            "spec": {
                "replicas": spec.replicas,
                "revisionHistoryLimit": 5,
                "progressDeadlineSeconds": spec.rollout.progress_deadline_seconds,
                "selector": {"matchLabels": selector_labels(pair)},
                "strategy": {
                    "type": "RollingUpdate",
                    # The old revision serves until the new pods pass /readyz.
                    "rollingUpdate": {"maxUnavailable": 0, "maxSurge": spec.rollout.max_surge},
                },
                "template": {
                    "metadata": {
                        "labels": pod_labels,
                        "annotations": {REVISION_LABEL: revision},
                    },
                    "spec": pod_spec,
                },
            },
        }
    )


def service(pair: PairRef, spec: SpeculativePairSpec) -> Manifest:
    return _stamped(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(pair, spec, pair.name),
            "spec": {
                "type": "ClusterIP",
                "selector": selector_labels(pair),
                "ports": [
                    {
                        "name": PORT_NAME,
                        "port": spec.serving.port,
                        "targetPort": PORT_NAME,
                        "protocol": "TCP",
                    }
                ],
            },
        }
    )
