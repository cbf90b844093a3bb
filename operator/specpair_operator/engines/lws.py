"""A pair larger than one node: a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) (pure).

Where the plan needs more GPUs than one node has, the pair runs as groups of
``nodes`` pods, one per node: the leader runs ``vllm serve`` with its API
server and the gate, the workers run ``vllm serve --headless`` with their
node rank. vLLM's native multi-node mode (``--nnodes``, ``--node-rank``,
``--master-addr``: the mp executor over torch.distributed, no Ray) spreads
tensor parallelism over the whole group; pipeline parallelism is never used
(vLLM does not combine it with speculative decoding). The LeaderWorkerSet
controller (kubernetes-sigs/lws) must be installed in the cluster: it
creates the pods, sets ``LWS_LEADER_ADDRESS`` and ``LWS_WORKER_INDEX`` in
them, and recreates a whole group when one of its pods fails.

The rollout keeps the old groups serving until new ones are ready
(``maxUnavailable: 0``, ``maxSurge``: the pair's ``rollout.maxSurge``).
`deployment_view` reads its status in the shape status.py reads a Deployment.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from specpair_operator import builders
from specpair_operator.api import SpeculativePairSpec
from specpair_operator.builders import REVISION_LABEL, Manifest, PairRef
from specpair_operator.engines.vllm import GROUP_TEMPLATE_KEY, pod_template
from specpair_operator.engines.vllm_args import Layout, serve_args, worker_args
from specpair_operator.rollback import ROLLBACK_HASH_PREFIX

GROUP = "leaderworkerset.x-k8s.io"
API_VERSION = f"{GROUP}/v1"
KIND = "LeaderWorkerSet"
PLURAL = "leaderworkersets"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"


def leader_worker_set(
    pair: PairRef, spec: SpeculativePairSpec, revision: str, shape: Layout, *, speculate: bool
) -> Manifest:
    leader = serve_args(pair.name, spec, shape, speculate=speculate)
    meta = builders._metadata(pair, spec, pair.name, {REVISION_LABEL: revision})
    return builders._stamped(
        {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": meta,
            "spec": {
                "replicas": spec.replicas,
                "startupPolicy": "LeaderCreated",
                "rolloutStrategy": {
                    "type": "RollingUpdate",
                    "rollingUpdateConfiguration": {
                        "maxUnavailable": 0,
                        "maxSurge": spec.rollout.max_surge,
                    },
                },
                "leaderWorkerTemplate": {
                    "size": shape.nodes,
                    "restartPolicy": "RecreateGroupOnPodRestart",
                    "leaderTemplate": pod_template(pair, spec, revision, shape, leader),
                    "workerTemplate": pod_template(
                        pair, spec, revision, shape, worker_args(leader), leader=False
                    ),
                },
            },
        }
    )


def is_leader(pod: dict[str, Any]) -> bool:
    """A pod that is no LeaderWorkerSet worker (workers serve no API)."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return str(labels.get(WORKER_INDEX_LABEL, "0")) == "0"


def deployment_view(lws: dict[str, Any]) -> dict[str, Any]:
    """The LeaderWorkerSet as the Deployment fields status.py and rollback.py read."""
    spec, status = lws.get("spec") or {}, lws.get("status") or {}
    template = (spec.get("leaderWorkerTemplate") or {}).get("leaderTemplate") or {}
    meta = dict(lws.get("metadata") or {})
    ready = int(status.get("readyReplicas") or 0)
    observed = status.get("observedGeneration")
    if observed is None and status:
        observed = meta.get("generation", 0)  # older controllers do not report it
    return {
        "apiVersion": lws.get("apiVersion"),
        "kind": KIND,
        "metadata": meta,
        "spec": {"replicas": spec.get("replicas", 1), "template": template},
        "status": {
            "observedGeneration": observed or 0,
            "replicas": int(status.get("replicas") or 0),
            "updatedReplicas": int(status.get("updatedReplicas") or 0),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "conditions": list(status.get("conditions") or []),
        },
    }


def rolled_back_group(group: dict[str, Any], template: dict[str, Any], good: str) -> dict[str, Any]:
    """The LeaderWorkerSet with the good revision's group template back (for a PUT)."""
    body = copy.deepcopy(group)
    body.pop("status", None)
    body["spec"]["leaderWorkerTemplate"] = copy.deepcopy(template)
    meta = body["metadata"]
    meta.setdefault("labels", {})[REVISION_LABEL] = good
    meta.setdefault("annotations", {})[builders.HASH_ANNOTATION] = ROLLBACK_HASH_PREFIX + good
    return body


def good_group_template(config_map: dict[str, Any] | None) -> dict[str, Any] | None:
    """The group template a revision's ConfigMap keeps, or None."""
    text = ((config_map or {}).get("data") or {}).get(GROUP_TEMPLATE_KEY)
    if not text:
        return None
    found: dict[str, Any] = json.loads(text)
    return found
