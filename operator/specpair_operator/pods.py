"""The pair's pods, and their runtime's HTTP endpoints reached through the pod IP.

The operator reads ``/readyz`` (why a new pod is not ready) and ``/metrics``
(acceptance) straight from each pod's IP and container port, as Prometheus
would. Every call has a short timeout; a failure returns None and is the
caller's to log, never fatal.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from specpair_operator.builders import CONTAINER_NAME
from specpair_operator.engines import metrics_container, readiness_container

TIMEOUT_SECONDS = 2.0


def is_ready(pod: Mapping[str, Any]) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return bool(cond.get("status") == "True")
    return False


def endpoint(pod: Mapping[str, Any], container_name: str = CONTAINER_NAME) -> str | None:
    """``http://<podIP>:<port>`` of a container (the runtime's), or None before it has an IP."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    for container in (pod.get("spec") or {}).get("containers") or []:
        if container.get("name") == container_name:
            for port in container.get("ports") or []:
                if port.get("containerPort"):
                    host = f"[{ip}]" if ":" in ip else ip
                    return f"http://{host}:{port['containerPort']}"
    return None


def fetch(url: str, timeout: float = TIMEOUT_SECONDS) -> tuple[int, str] | None:
    """(status, body) of a GET, also for 5xx; None when the pod cannot be reached."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return int(reply.status), reply.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return int(error.code), error.read().decode(errors="replace")
    except (OSError, ValueError):
        return None


def metrics_endpoint(pod: Mapping[str, Any]) -> str | None:
    """Where the pod's engine serves ``/metrics`` (the runtime; vLLM itself)."""
    return endpoint(pod, metrics_container(pod))


def readiness_body(pod: Mapping[str, Any]) -> dict[str, Any] | None:
    # The runtime's /readyz; beside vLLM the gate's, which has the same body.
    base = endpoint(pod, readiness_container(pod))
    reply = None if base is None else fetch(f"{base}/readyz")
    if reply is None:
        return None
    try:
        body = json.loads(reply[1])
    except ValueError:
        return None
    return body if isinstance(body, dict) else None
