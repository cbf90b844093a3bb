"""The de-duplicating work queue and the watched store."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from specpair_operator.store import DEPLOYMENT, POD, Store
from specpair_operator.workqueue import ShutDown, WorkQueue


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_key_added_twice_is_handed_out_once() -> None:
    queue: WorkQueue[str] = WorkQueue()
    for key in ("a", "b", "a", "a"):
        queue.add(key)
    assert [queue.get(0), queue.get(0), queue.get(0)] == ["a", "b", None]


def test_a_key_in_work_is_not_handed_out_again_until_done() -> None:
    queue: WorkQueue[str] = WorkQueue()
    queue.add("a")
    assert queue.get(0) == "a"
    queue.add("a")  # changed while a worker holds it
    assert queue.get(0) is None
    queue.done("a")
    assert queue.get(0) == "a"
    queue.done("a")
    assert queue.get(0) is None


def test_delayed_keys_and_backoff() -> None:
    clock = Clock()
    queue: WorkQueue[str] = WorkQueue(base=1.0, cap=4.0, clock=clock)
    assert [queue.backoff("a") for _ in range(4)] == [1.0, 2.0, 4.0, 4.0]
    queue.forget("a")
    assert queue.backoff("a") == 1.0
    queue.add_after("a", 2.0)
    assert queue.get(0) is None
    clock.now = 2.5
    assert queue.get(0) == "a"


def test_shutdown_wakes_a_waiting_worker() -> None:
    queue: WorkQueue[str] = WorkQueue()
    raised = threading.Event()

    def worker() -> None:
        with pytest.raises(ShutDown):
            queue.get()
        raised.set()

    thread = threading.Thread(target=worker)
    thread.start()
    queue.shutdown()
    thread.join(5)
    assert raised.is_set()


def obj(name: str, version: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "resourceVersion": version,
            "labels": labels or {},
            "managedFields": [{"manager": "x"}],
        }
    }


def test_store_keeps_the_newest_copy() -> None:
    store = Store()
    assert store.put(DEPLOYMENT, obj("a", "5"))
    assert not store.put(DEPLOYMENT, obj("a", "5"))  # the watch echo of our own write
    assert not store.put(DEPLOYMENT, obj("a", "4"))  # a late event
    assert store.put(DEPLOYMENT, obj("a", "6", {"app": "x"}))
    found = store.get(DEPLOYMENT, "ns", "a")
    assert found is not None and found["metadata"]["resourceVersion"] == "6"
    assert "managedFields" not in found["metadata"]
    assert [o["metadata"]["name"] for o in store.select(DEPLOYMENT, "ns", {"app": "x"})] == ["a"]
    assert store.select(DEPLOYMENT, "other", {}) == []
    store.remove(DEPLOYMENT, "ns", "a")
    assert store.get(DEPLOYMENT, "ns", "a") is None


def test_store_finds_a_pairs_objects_by_index_and_follows_relabels() -> None:
    store = Store()
    instance = "app.kubernetes.io/instance"
    for name, pair in (("a-1", "a"), ("a-2", "a"), ("b-1", "b")):
        store.put(POD, obj(name, "1", {instance: pair, "rev": "r1"}))
    names = {o["metadata"]["name"] for o in store.select(POD, "ns", {instance: "a"})}
    assert names == {"a-1", "a-2"}
    assert [
        o["metadata"]["name"] for o in store.select(POD, "ns", {instance: "a", "rev": "r2"})
    ] == []
    store.put(POD, obj("a-2", "2", {instance: "b", "rev": "r1"}))  # relabelled
    assert {o["metadata"]["name"] for o in store.select(POD, "ns", {instance: "b"})} == {
        "b-1",
        "a-2",
    }
    store.remove(POD, "ns", "a-1")
    assert store.select(POD, "ns", {instance: "a"}) == []
    assert store.select(POD, "other", {instance: "b"}) == []
    assert len(store.select(POD, None, {instance: "b"})) == 2  # all namespaces: a scan


def test_store_keeps_of_a_pod_only_what_the_operator_reads() -> None:
    pod = obj("p", "1")
    pod["spec"] = {
        "containers": [{"name": "runtime", "image": "i", "ports": [{"containerPort": 8000}]}],
        "volumes": [{"name": "v"}],
    }
    pod["status"] = {"podIP": "10.0.0.1", "phase": "Running"}
    store = Store()
    store.put(POD, pod)
    kept = store.peek(POD, "ns", "p")
    assert kept is not None
    assert kept["spec"] == {"containers": [{"name": "runtime", "ports": [{"containerPort": 8000}]}]}
    assert kept["status"] == pod["status"] and "managedFields" not in kept["metadata"]
    assert pod["spec"]["volumes"] and pod["metadata"]["managedFields"]  # the event is untouched
