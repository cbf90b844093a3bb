"""A LeaderWorkerSet CRD (leaderworkerset.x-k8s.io/v1) for the test apiserver, built offline.

The operator renders a LeaderWorkerSet where a vLLM pair needs more GPUs than
one node has. The tests install this CRD on the v1.20 test apiserver and
create the rendered objects there, so the apiserver's own structural-schema
validation checks every field the operator writes.

The schema follows the LWS v1 API (``LeaderWorkerSetSpec``: ``replicas``,
``leaderWorkerTemplate`` with ``leaderTemplate``, ``workerTemplate``,
``size``, ``restartPolicy``, ``subGroupPolicy``; ``rolloutStrategy``,
``startupPolicy``, ``networkConfig``; the status with ``conditions``,
``readyReplicas``, ``updatedReplicas``, ``replicas``, ``hpaPodSelector``),
with the same enums and defaults. The pod templates are core/v1
``PodTemplateSpec``, taken from the schemas that the pinned
``kubernetes-validate`` package ships (no network) and made structural, as
controller-gen makes them for the upstream CRD: references inlined,
int-or-string marked, descriptions dropped to keep the object small.

    python -m tools.lws_crd > lws-crd.yaml
"""

from __future__ import annotations

import json
import sys
from functools import cache
from pathlib import Path
from typing import Any

import yaml

GROUP = "leaderworkerset.x-k8s.io"
VERSION = "v1"
KIND = "LeaderWorkerSet"
PLURAL = "leaderworkersets"
# The oldest schema set kubernetes-validate ships; pod fields newer than the operator
# uses make no difference.
SCHEMA_SET = "v1.25.0-local"
_INT_OR_STRING = {"io.k8s.apimachinery.pkg.util.intstr.IntOrString"}
_QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
_OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"

Schema = dict[str, Any]


@cache
def _definitions() -> dict[str, Schema]:
    import kubernetes_validate

    root = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / SCHEMA_SET
    data: dict[str, Any] = json.loads((root / "_definitions.json").read_text())
    defs: dict[str, Schema] = data.get("$defs") or data["definitions"]
    return defs


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _template_metadata() -> Schema:
    # What controller-gen writes for an embedded template's ObjectMeta.
    strings = {"type": "object", "additionalProperties": {"type": "string"}}
    return {
        "type": "object",
        "properties": {
            "labels": strings,
            "annotations": strings,
            "name": {"type": "string"},
            "namespace": {"type": "string"},
            "finalizers": {"type": "array", "items": {"type": "string"}},
        },
    }


def structural(node: Schema, seen: tuple[str, ...] = ()) -> Schema:
    """A JSON schema from kubernetes-validate as a structural CRD schema."""
    if "$ref" in node:
        name = _ref_name(node["$ref"])
        if name in _INT_OR_STRING or name == _QUANTITY:
            return {"x-kubernetes-int-or-string": True}
        if name == _OBJECT_META:
            return _template_metadata()
        if name in seen:  # core/v1 has no cycles; guard all the same
            return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        return structural(_definitions()[name], (*seen, name))
    if "oneOf" in node or "anyOf" in node:
        return {"x-kubernetes-int-or-string": True}
    out: Schema = {}
    kind = node.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        kind = kinds[0] if kinds else None
    if kind is not None:
        out["type"] = kind
    if node.get("format") == "int-or-string":
        return {"x-kubernetes-int-or-string": True}
    if "format" in node and kind in ("integer", "number"):
        out["format"] = node["format"]
    if "enum" in node:
        out["enum"] = [v for v in node["enum"] if v is not None]
    if "properties" in node:
        out["properties"] = {k: structural(v, seen) for k, v in node["properties"].items()}
    if isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = structural(node["additionalProperties"], seen)
    if "items" in node:
        out["items"] = structural(node["items"], seen)
    if node.get("required"):
        out["required"] = list(node["required"])
    if (
        out.get("type") == "object"
        and "properties" not in out
        and "additionalProperties" not in out
    ):
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def pod_template_schema() -> Schema:
    return structural({"$ref": "#/$defs/io.k8s.api.core.v1.PodTemplateSpec"})


def _int_or_string(default: int) -> Schema:
    return {
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "x-kubernetes-int-or-string": True,
        "default": default,
    }


def _spec_schema() -> Schema:
    template = pod_template_schema()
    return {
        "type": "object",
        "required": ["leaderWorkerTemplate"],
        "properties": {
            "replicas": {"type": "integer", "format": "int32", "default": 1},
            "startupPolicy": {
                "type": "string",
                "enum": ["LeaderCreated", "LeaderReady"],
                "default": "LeaderCreated",
            },
            "leaderWorkerTemplate": {
                "type": "object",
                "required": ["workerTemplate"],
                "properties": {
                    "leaderTemplate": template,
                    "workerTemplate": template,
                    "size": {"type": "integer", "format": "int32", "default": 1, "minimum": 1},
                    "restartPolicy": {
                        "type": "string",
                        "enum": [
                            "Default",
                            "RecreateGroupOnPodRestart",
                            "RecreateGroupAfterStart",
                            "None",
                        ],
                        "default": "RecreateGroupOnPodRestart",
                    },
                    "subGroupPolicy": {
                        "type": "object",
                        "properties": {
                            "subGroupPolicyType": {
                                "type": "string",
                                "enum": ["LeaderWorker", "LeaderExcluded"],
                                "default": "LeaderWorker",
                            },
                            "subGroupSize": {"type": "integer", "format": "int32"},
                        },
                    },
                },
            },
            "rolloutStrategy": {
                "type": "object",
                "required": ["type"],
                "properties": {
                    "type": {
                        "type": "string",
                        "enum": ["RollingUpdate"],
                        "default": "RollingUpdate",
                    },
                    "rollingUpdateConfiguration": {
                        "type": "object",
                        "properties": {
                            "partition": {"type": "integer", "format": "int32", "default": 0},
                            "maxUnavailable": _int_or_string(1),
                            "maxSurge": _int_or_string(0),
                        },
                    },
                },
            },
            "networkConfig": {
                "type": "object",
                "required": ["subdomainPolicy"],
                "properties": {
                    "subdomainPolicy": {"type": "string", "enum": ["Shared", "UniquePerReplica"]}
                },
            },
        },
    }


def _status_schema() -> Schema:
    condition = {
        "type": "object",
        "required": ["type", "status", "lastTransitionTime", "reason", "message"],
        "properties": {
            "type": {"type": "string"},
            "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
            "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0},
            "lastTransitionTime": {"type": "string", "format": "date-time"},
            "reason": {"type": "string"},
            "message": {"type": "string"},
        },
    }
    counts = {
        k: {"type": "integer", "format": "int32"}
        for k in ("readyReplicas", "updatedReplicas", "replicas")
    }
    return {
        "type": "object",
        "properties": {
            "conditions": {"type": "array", "items": condition},
            **counts,
            "hpaPodSelector": {"type": "string"},
            "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0},
        },
    }


def build_crd() -> Schema:
    columns = [
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
        {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas"},
        {"name": "Up-to-date", "type": "integer", "jsonPath": ".status.updatedReplicas"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": ["lws"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.hpaPodSelector",
                        },
                    },
                    "additionalPrinterColumns": columns,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": _spec_schema(),
                                "status": _status_schema(),
                            },
                        }
                    },
                }
            ],
        },
    }


def render_crd() -> str:
    return yaml.safe_dump(build_crd(), sort_keys=False)


if __name__ == "__main__":
    sys.stdout.write(render_crd())
