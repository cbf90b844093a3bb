"""The kopf layer: watch streams in, the `controller.Controller` does the rest.

kopf keeps one watch stream per kind (it lists once, then follows changes,
reconnects and backs off), selected server-side by label: the pairs, their
children (Deployments, ReplicaSets, Pods, ConfigMaps, Services, labelled
``app.kubernetes.io/managed-by=specpair-operator``) and the GPU nodes
(``nvidia.com/gpu.memory``). Every event goes to `Controller.observe`.

Only ``@kopf.on.event`` handlers are used: kopf then keeps no state on the
pairs (no progress or diff-base annotations, no finalizers), and writes
nothing itself. Retries, backoff and the resync are the controller's.

Settings come from the environment so that ``kopf run -m
specpair_operator.handlers`` and ``python -m specpair_operator run`` behave
the same: ``SPECPAIR_RESYNC_SECONDS`` (15), ``SPECPAIR_WATCH_NAMESPACES``
(comma separated; empty = all), ``SPECPAIR_METRICS_PORT`` (0 = off),
``SPECPAIR_METRICS_ADDRESS`` (127.0.0.1), ``SPECPAIR_SCRAPE_SECONDS`` (30),
``SPECPAIR_WORKERS`` (4); leader election with ``SPECPAIR_LEADER_ELECTION``
(``1``), ``SPECPAIR_LEASE_NAMESPACE``, ``SPECPAIR_LEASE_NAME``,
``SPECPAIR_LEASE_SECONDS`` (8) and ``SPECPAIR_IDENTITY`` (see `leader.py`).
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import kopf

from specpair_operator import api, metrics
from specpair_operator.controller import Controller, Watched
from specpair_operator.kube import Kube, load_api_client
from specpair_operator.leader import LeaderElector
from specpair_operator.store import (
    CONFIG_MAP,
    DEPLOYMENT,
    LEADER_WORKER_SET,
    NODE,
    PAIR,
    POD,
    REPLICA_SET,
    SERVICE,
)

log = logging.getLogger("specpair.operator")


def _env_float(name: str, default: str) -> float:
    return float(os.environ.get(name, default))


def watched_namespaces() -> list[str]:
    return [n for n in os.environ.get("SPECPAIR_WATCH_NAMESPACES", "").split(",") if n]


def _leader(kube: Kube) -> LeaderElector | None:
    if os.environ.get("SPECPAIR_LEADER_ELECTION", "") not in ("1", "true"):
        return None
    identity = os.environ.get("SPECPAIR_IDENTITY") or f"{socket.gethostname()}-{os.getpid()}"
    return LeaderElector(
        kube,
        namespace=os.environ.get("SPECPAIR_LEASE_NAMESPACE") or "default",
        name=os.environ.get("SPECPAIR_LEASE_NAME") or "specpair-operator",
        identity=identity,
        lease_seconds=int(_env_float("SPECPAIR_LEASE_SECONDS", "8")),
    )


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # kopf's own "Handler succeeded" events would be a write per event; ours are explicit.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    for kind, selector in Watched.SELECTORS.items():
        version, plural, _namespaced = Watched.PATHS[kind]
        group = version.rpartition("/")[0]
        settings.watching.label_selectors[group, plural] = selector
    kube = Kube(load_api_client())
    controller = Controller(
        kube,
        namespaces=watched_namespaces(),
        resync_seconds=_env_float("SPECPAIR_RESYNC_SECONDS", "15"),
        scrape_seconds=_env_float("SPECPAIR_SCRAPE_SECONDS", "30"),
        workers=int(_env_float("SPECPAIR_WORKERS", "4")),
        leader=_leader(kube),
    )
    memo.controller = controller
    controller.start()
    port = int(os.environ.get("SPECPAIR_METRICS_PORT", "0"))
    if port:
        metrics.serve(port, os.environ.get("SPECPAIR_METRICS_ADDRESS", "127.0.0.1"))


@kopf.on.cleanup()
def stop_controller(memo: kopf.Memo, **_: Any) -> None:
    memo.controller.stop()


def _observe(kind: str, event: kopf.RawEvent, memo: kopf.Memo) -> None:
    controller: Controller = memo.controller
    controller.observe(kind, event.get("type"), event["object"])


@kopf.on.event(api.GROUP, api.VERSION, api.PLURAL)
async def pair_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    _observe(PAIR, event, memo)


@kopf.on.event("apps", "v1", "deployments")
async def deployment_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    _observe(DEPLOYMENT, event, memo)


@kopf.on.event("apps", "v1", "replicasets")
async def replica_set_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    _observe(REPLICA_SET, event, memo)


@kopf.on.event("", "v1", "pods")
async def pod_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    _observe(POD, event, memo)


@kopf.on.event("", "v1", "configmaps")
async def config_map_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    _observe(CONFIG_MAP, event, memo)


@kopf.on.event("", "v1", "services")
async def service_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    _observe(SERVICE, event, memo)


@kopf.on.event("", "v1", "nodes")
async def node_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    _observe(NODE, event, memo)


# Engine vllm past one node. kopf serves this only where the LeaderWorkerSet CRD exists.
@kopf.on.event("leaderworkerset.x-k8s.io", "v1", "leaderworkersets")
async def leader_worker_set_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    _observe(LEADER_WORKER_SET, event, memo)
