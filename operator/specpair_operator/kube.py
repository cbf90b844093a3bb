"""A small JSON client over the kubernetes package's ApiClient.

The operator handles manifests as plain dicts, so it calls the REST paths
directly and reads the raw JSON (``_preload_content=False``). That also
avoids the typed models, which cannot parse some v1.20 replies (a Service
delete answers with a Status the client mistakes for a V1ServiceStatus).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from specpair_operator import api
from specpair_operator.metrics import API_REQUESTS

T = TypeVar("T")
Obj = dict[str, Any]

MERGE_PATCH = "application/merge-patch+json"


def load_api_client() -> client.ApiClient:
    """In-cluster config when running in a pod, else $KUBECONFIG / ~/.kube/config."""
    try:
        config.load_incluster_config()  # type: ignore[no-untyped-call]
        return client.ApiClient()
    except config.ConfigException:
        api_client: client.ApiClient = config.new_client_from_config()  # type: ignore[no-untyped-call]
        return api_client


def path_for(api_version: str, plural: str, namespace: str | None, name: str | None = None) -> str:
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    if namespace is not None:
        base += f"/namespaces/{namespace}"
    base += f"/{plural}"
    return base if name is None else f"{base}/{name}"


PLURALS = {
    "ConfigMap": "configmaps",
    "Service": "services",
    "Deployment": "deployments",
    "LeaderWorkerSet": "leaderworkersets",
}


def object_path(obj: Obj, *, collection: bool = False) -> str:
    meta = obj["metadata"]
    plural = PLURALS[obj["kind"]]
    name = None if collection else meta["name"]
    return path_for(obj["apiVersion"], plural, meta.get("namespace"), name)


def resource_of(path: str) -> str:
    """The resource a REST path names, e.g. ``speculativepairs/status`` or ``leases``."""
    parts = [p for p in path.split("?", 1)[0].split("/") if p]
    # /api/v1[/namespaces/NS]/PLURAL[/NAME[/SUB]] or /apis/GROUP/VERSION/...
    rest = parts[2:] if parts[:1] == ["api"] else parts[3:]
    if len(rest) >= 2 and rest[0] == "namespaces" and len(rest) > 2:
        rest = rest[2:]
    if not rest:
        return ""
    return rest[0] if len(rest) < 3 else f"{rest[0]}/{rest[2]}"


def pair_path(namespace: str, name: str) -> str:
    return path_for(api.API_VERSION, api.PLURAL, namespace, name)


class Kube:
    """GET/POST/PUT/PATCH on JSON paths; errors are ApiException with .status."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.api_client = api_client

    def request(
        self,
        method: str,
        path: str,
        body: object | None = None,
        *,
        content_type: str = "application/json",
        query: list[tuple[str, str]] | None = None,
    ) -> Obj:
        API_REQUESTS.labels(verb=method, resource=resource_of(path)).inc()
        request = self.api_client.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or [],
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api_client.call_api(*request)
        data = response.read()  # type: ignore[no-untyped-call]
        if not 200 <= response.status <= 299:
            raise ApiException.from_response(http_resp=response, body=data, data=None)
        return json.loads(data) if data else {}

    def get(self, path: str) -> Obj | None:
        """The object, or None on 404."""
        try:
            return self.request("GET", path)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def list(self, path: str, label_selector: str | None = None) -> list[Obj]:
        query = [("labelSelector", label_selector)] if label_selector else []
        return list(self.request("GET", path, query=query).get("items") or [])

    def create(self, path: str, body: Obj) -> Obj:
        return self.request("POST", path, body)

    def replace(self, path: str, body: Obj) -> Obj:
        return self.request("PUT", path, body)

    def merge_patch(self, path: str, patch: Obj) -> Obj:
        return self.request("PATCH", path, patch, content_type=MERGE_PATCH)

    def delete(self, path: str) -> None:
        try:
            self.request("DELETE", path)
        except ApiException as error:
            if error.status != 404:
                raise


def with_conflict_retry(action: Callable[[], T], *, attempts: int = 5, delay: float = 0.2) -> T:
    """Run ``action``; on 409 (a stale resourceVersion) retry with exponential backoff."""
    for attempt in range(attempts):
        try:
            return action()
        except ApiException as error:
            if error.status != 409 or attempt == attempts - 1:
                raise
            time.sleep(delay * 2**attempt)
    raise AssertionError("unreachable")
