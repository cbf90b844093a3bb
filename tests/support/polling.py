"""Small helpers the Kubernetes-facing tests share: polling and 404-tolerant reads."""

from __future__ import annotations

import urllib.error
from collections.abc import Callable
from typing import Any, TypeVar

from tools.control_plane import ControlPlane
from tools.deploy import wait_until

PAIRS = "/apis/specpair.dev/v1alpha1/namespaces/{ns}/speculativepairs"
T = TypeVar("T")


def wait_for(
    probe: Callable[[], T | None], what: str, timeout: float = 60.0, interval: float = 0.2
) -> T:
    """Poll ``probe`` until it returns something truthy; fail naming ``what``."""
    return wait_until(probe, what, timeout, interval, error=AssertionError)


def get_or_none(plane: ControlPlane, path: str) -> dict[str, Any] | None:
    """GET an API path; None on 404."""
    try:
        found: dict[str, Any] = plane.api("GET", path)
        return found
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return None
        raise
