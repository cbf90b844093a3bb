"""The resource label of the operator's own request counter."""

from __future__ import annotations

import pytest

from specpair_operator.kube import resource_of


@pytest.mark.parametrize(
    ("path", "resource"),
    [
        ("/api/v1/namespaces/ns/secrets/api-key", "secrets"),
        (
            "/apis/specpair.dev/v1alpha1/namespaces/ns/speculativepairs/p/status",
            "speculativepairs/status",
        ),
        ("/apis/coordination.k8s.io/v1/namespaces/ns/leases/specpair-operator", "leases"),
        ("/apis/apps/v1/namespaces/ns/deployments", "deployments"),
        ("/api/v1/nodes?labelSelector=x", "nodes"),
        ("/api/v1/namespaces/ns", "namespaces"),
    ],
)
def test_resource_of(path: str, resource: str) -> None:
    assert resource_of(path) == resource
