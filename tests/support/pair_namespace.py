"""One test namespace on the real control plane, with the reads the operator's tests repeat.

`PairNamespace` names the paths of a pair's children, reads them (None on
404), waits for them, and patches pairs the way a user does (``kubectl
patch``). The operator itself runs as a process (`operator_process.Operator`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tools.control_plane import ControlPlane

from tests.support.k8s_fixtures import Kubectl
from tests.support.operator_process import api, create_pair, items, pair_path, settled
from tests.support.polling import PAIRS, get_or_none, wait_for

# Collection paths of what a pair owns, and of what the tests read next to it.
COLLECTIONS = {
    "deployments": "/apis/apps/v1/namespaces/{ns}/deployments",
    "services": "/api/v1/namespaces/{ns}/services",
    "configmaps": "/api/v1/namespaces/{ns}/configmaps",
    "pods": "/api/v1/namespaces/{ns}/pods",
    "events": "/api/v1/namespaces/{ns}/events",
    "pairs": PAIRS,
}
Obj = dict[str, Any]


@dataclass(frozen=True)
class PairNamespace:
    plane: ControlPlane
    kubectl: Kubectl
    ns: str

    def path(self, kind: str, name: str | None = None) -> str:
        base = COLLECTIONS[kind].format(ns=self.ns)
        return base if name is None else f"{base}/{name}"

    def get(self, kind: str, name: str) -> Obj | None:
        """The object, or None when it does not exist."""
        return get_or_none(self.plane, self.path(kind, name))

    def read(self, kind: str, name: str) -> Obj:
        """The object; an error when it does not exist."""
        return api(self.plane, "GET", self.path(kind, name))

    def list(self, kind: str, instance: str | None = None) -> list[Obj]:
        """The objects of ``kind``, only those of pair ``instance`` when given."""
        query = (
            "" if instance is None else f"?labelSelector=app.kubernetes.io/instance%3D{instance}"
        )
        return items(self.plane, self.path(kind) + query)

    def wait(
        self,
        kind: str,
        name: str,
        what: str,
        check: Callable[[Obj], bool] = lambda _: True,
        timeout: float = 60.0,
    ) -> Obj:
        """The object once it exists and passes ``check``."""

        def probe() -> Obj | None:
            found = self.get(kind, name)
            return found if found is not None and check(found) else None

        return wait_for(probe, what, timeout=timeout)

    def create(self, body: Obj) -> Obj:
        """Create a pair (and the sample's Secrets it may name)."""
        return create_pair(self.plane, self.ns, body)

    def patch(self, name: str, patch: Obj) -> None:
        """``kubectl patch spair`` with a merge patch, as a user does."""
        self.kubectl("patch", "spair", "-n", self.ns, name, "--type=merge", "-p", json.dumps(patch))

    def settled(self, name: str, what: str = "the pair's status", timeout: float = 60.0) -> Obj:
        """The pair once its status describes its current generation."""
        return wait_for(lambda: settled(self.plane, self.ns, name), what, timeout=timeout)

    def pair(self, name: str) -> Obj:
        return api(self.plane, "GET", pair_path(self.ns, name))

    def template_revision(self, name: str) -> str | None:
        """The revision label of the pair's Deployment's pod template (None: no Deployment)."""
        dep = self.get("deployments", name)
        if dep is None:
            return None
        return str(dep["spec"]["template"]["metadata"]["labels"]["specpair.dev/revision"])

    def config_map_names(self, instance: str) -> set[str]:
        return {c["metadata"]["name"] for c in self.list("configmaps", instance)}

    def event_reasons(self, type_: str | None = "Warning") -> set[str]:
        """Reasons of the namespace's Events of ``type_`` (None: of any type)."""
        return {e["reason"] for e in self.list("events") if type_ in (None, e["type"])}

    def get_spair(self, *names: str) -> str:
        """What ``kubectl get spair`` prints."""
        return self.kubectl("get", "spair", "-n", self.ns, *names).stdout

    def columns(self, name: str) -> dict[str, str]:
        """One pair's ``kubectl get spair`` row, by column header."""
        header, row = self.get_spair(name).split("\n")[:2]
        return dict(zip(header.split(), row.split(), strict=False))
