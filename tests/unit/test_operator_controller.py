"""Watch events into the work queue, and what a resync round may skip (no API involved)."""

from __future__ import annotations

from typing import Any, cast

from specpair_operator.controller import Controller
from specpair_operator.kube import Kube
from specpair_operator.store import DEPLOYMENT, NODE, PAIR, POD


def controller() -> Controller:
    # The API is never called by observe() or the resync's choice.
    return Controller(cast(Kube, None), namespaces=[], resync_seconds=15, scrape_seconds=30)


def obj(
    name: str, version: int, labels: dict[str, str] | None = None, **rest: Any
) -> dict[str, Any]:
    meta = {
        "name": name,
        "namespace": "ns",
        "resourceVersion": str(version),
        "labels": labels or {},
    }
    return {"metadata": meta, **rest}


def drain(c: Controller) -> list[tuple[str, str]]:
    keys = []
    while (key := c.queue.get(timeout=0)) is not None:
        keys.append(key)
        c.queue.done(key)
    return keys


CHILD = {"app.kubernetes.io/instance": "p"}


def test_events_queue_their_pair_once_and_echoes_of_own_writes_not_at_all() -> None:
    c = controller()
    c.observe(PAIR, None, obj("p", 1))
    c.observe(DEPLOYMENT, "ADDED", obj("p", 2, CHILD))
    assert drain(c) == [("ns", "p")]
    c.observe(DEPLOYMENT, "MODIFIED", obj("p", 2, CHILD))  # the same version: our own write
    assert drain(c) == []
    c.observe(DEPLOYMENT, "DELETED", obj("p", 3, CHILD))  # deleted by hand: put it back
    assert drain(c) == [("ns", "p")]


def test_pods_matter_only_while_a_new_revision_rolls_over_a_serving_one() -> None:
    c = controller()
    c.observe(PAIR, None, obj("p", 1))
    drain(c)
    pod = {**CHILD, "specpair.dev/revision": "r1"}
    c.observe(POD, "ADDED", obj("p-a", 2, pod))  # first rollout: the Deployment tells
    assert drain(c) == []
    c.observe(PAIR, "MODIFIED", obj("p", 3, status={"currentRevision": "r1"}))
    drain(c)
    c.observe(POD, "MODIFIED", obj("p-a", 4, pod))  # a pod of the serving revision
    assert drain(c) == []
    c.observe(POD, "ADDED", obj("p-b", 5, {**CHILD, "specpair.dev/revision": "r2"}))
    assert drain(c) == [("ns", "p")]


def test_node_heartbeats_queue_nothing_and_readiness_changes_queue_every_pair() -> None:
    c = controller()
    for name in ("p", "q"):
        c.observe(PAIR, None, obj(name, 1))
    drain(c)

    def node(version: int, ready: str, beat: str) -> dict[str, Any]:
        cond = {"type": "Ready", "status": ready, "lastHeartbeatTime": beat}
        labels = {"nvidia.com/gpu.memory": "81920"}
        return obj("n", version, labels, status={"conditions": [cond]})

    c.observe(NODE, None, node(1, "True", "t1"))
    drain(c)
    c.observe(NODE, "MODIFIED", node(2, "True", "t2"))
    assert drain(c) == []
    c.observe(NODE, "MODIFIED", node(3, "False", "t3"))
    assert sorted(drain(c)) == [("ns", "p"), ("ns", "q")]


def test_a_resync_skips_settled_pairs_until_an_event_concerns_them() -> None:
    c = controller()
    for name in ("p", "q"):
        c.observe(PAIR, None, obj(name, 1))
    drain(c)
    for key in (("ns", "p"), ("ns", "q")):
        c.record_settled(key, c.mark(key), settled=True)
    assert c.resync_keys(full=False) == []
    assert sorted(c.resync_keys(full=True)) == [("ns", "p"), ("ns", "q")]  # the safety net
    c.observe(DEPLOYMENT, "MODIFIED", obj("q", 7, {"app.kubernetes.io/instance": "q"}))
    assert c.resync_keys(full=False) == [("ns", "q")]
    c.record_settled(("ns", "p"), c.mark(("ns", "p")), settled=False)  # e.g. waits on a Secret
    assert sorted(c.resync_keys(full=False)) == [("ns", "p"), ("ns", "q")]
