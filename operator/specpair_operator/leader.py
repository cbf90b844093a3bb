"""Leader election on a ``coordination.k8s.io/v1`` Lease, as client-go does it.

Every replica watches and keeps its store warm; only the leader reconciles,
scrapes and writes. The leader renews the Lease every ``lease/4`` seconds.
A standby takes the Lease over once it has seen no renewal for ``lease``
seconds (measured on its own clock from when it last saw the record change,
so clock skew between nodes does not matter), checking every ``lease/4``
seconds: a killed leader is replaced within ``lease + 2 x lease/4`` seconds
(12 s with the default 8 s). A leader that cannot renew for ``0.625 x
lease`` seconds stops acting before anyone else may start. A leader that
stops cleanly (SIGTERM) releases the Lease, so a standby takes over at its
next check.

Cost: one PUT per renewal from the leader, one GET per check from each
standby; nothing per pair.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.exceptions import ApiException

from specpair_operator.kube import Kube, Obj

log = logging.getLogger("specpair.leader")

LEASE_API = "/apis/coordination.k8s.io/v1"


def micro_time(moment: datetime) -> str:
    """metav1.MicroTime: RFC 3339 with microseconds, in UTC."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_path(namespace: str, name: str | None = None) -> str:
    base = f"{LEASE_API}/namespaces/{namespace}/leases"
    return base if name is None else f"{base}/{name}"


def taken_spec(
    old: Mapping[str, Any], identity: str, lease_seconds: int, now: datetime
) -> dict[str, Any]:
    """The Lease spec after ``identity`` acquires or renews it (pure)."""
    renewing = old.get("holderIdentity") == identity
    transitions = int(old.get("leaseTransitions") or 0)
    return {
        "holderIdentity": identity,
        "leaseDurationSeconds": lease_seconds,
        "acquireTime": old.get("acquireTime") if renewing else micro_time(now),
        "renewTime": micro_time(now),
        "leaseTransitions": transitions if renewing else transitions + 1,
    }


def released_spec(old: Mapping[str, Any], now: datetime) -> dict[str, Any]:
    """The Lease spec of a leader stepping down: no holder, so a standby may take it."""
    return {**old, "holderIdentity": None, "leaseDurationSeconds": 1, "renewTime": micro_time(now)}


def may_take(holder: str | None, identity: str, seen_for: float, lease_seconds: float) -> bool:
    """Whether ``identity`` may take a Lease whose record has not changed for ``seen_for`` s."""
    return not holder or holder == identity or seen_for > lease_seconds


@dataclass
class LeaderElector:
    kube: Kube
    namespace: str
    name: str
    identity: str
    lease_seconds: int = 8
    clock: Callable[[], float] = time.monotonic
    on_started: Callable[[], None] = lambda: None
    _leading: bool = field(default=False, init=False)
    _renewed_at: float = field(default=float("-inf"), init=False)
    _record: Obj | None = field(default=None, init=False)
    _observed_version: str | None = field(default=None, init=False)
    _observed_at: float = field(default=0.0, init=False)

    @property
    def period(self) -> float:
        return self.lease_seconds / 4

    @property
    def renew_deadline(self) -> float:
        return self.lease_seconds * 0.625

    def is_leader(self) -> bool:
        """True while this replica holds a Lease it renewed recently enough to act on."""
        return self._leading and self.clock() - self._renewed_at < self.renew_deadline

    def _held_by_other(self) -> bool:
        holder = ((self._record or {}).get("spec") or {}).get("holderIdentity")
        return bool(holder) and holder != self.identity

    def _observe(self, lease: Obj) -> None:
        version = lease["metadata"].get("resourceVersion")
        if version != self._observed_version:
            self._observed_version, self._observed_at = version, self.clock()
        self._record = lease

    def try_acquire_or_renew(self) -> bool:
        """One round: True when this replica holds the Lease afterwards."""
        now = datetime.now(UTC)
        lease = self._record if self._leading else None
        if lease is None:
            lease = self.kube.get(lease_path(self.namespace, self.name))
        if lease is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": taken_spec({}, self.identity, self.lease_seconds, now),
            }
            try:
                self._observe(self.kube.create(lease_path(self.namespace), body))
            except ApiException as error:
                if error.status == 409:
                    return False  # another replica created it first
                raise
            return True
        self._observe(lease)
        spec = lease.get("spec") or {}
        seen_for = self.clock() - self._observed_at
        if not may_take(spec.get("holderIdentity"), self.identity, seen_for, self.lease_seconds):
            return False
        body = {**lease, "spec": taken_spec(spec, self.identity, self.lease_seconds, now)}
        try:
            self._observe(self.kube.replace(lease_path(self.namespace, self.name), body))
        except ApiException as error:
            if error.status == 409:
                self._record = None  # changed meanwhile: read it again next round
                return False
            raise
        return True

    def run(self, stop: threading.Event) -> None:
        """Elect and renew until ``stop``; then release the Lease if held."""
        while not stop.is_set():
            try:
                held = self.try_acquire_or_renew()
            except Exception as error:  # the API may be briefly unreachable
                log.warning(f"leader election: {error}")
                self._record = None
                held = False
            if held:
                self._renewed_at = self.clock()
                if not self._leading:
                    self._leading = True
                    log.info(f"{self.identity} is the leader ({self.namespace}/{self.name})")
                    self.on_started()
            elif self._leading and (not self.is_leader() or self._held_by_other()):
                self._leading = False
                log.warning(f"{self.identity} lost the lease; standing by")
            stop.wait(self.period)
        self.release()

    def release(self) -> None:
        """Give the Lease up (best effort), so that a standby need not wait for it to expire."""
        if not self._leading or self._record is None:
            return
        self._leading = False
        record = self._record
        body = {**record, "spec": released_spec(record.get("spec") or {}, datetime.now(UTC))}
        try:
            self.kube.replace(lease_path(self.namespace, self.name), body)
            log.info(f"{self.identity} released the lease")
        except Exception as error:
            log.warning(f"leader election: could not release the lease: {error}")
