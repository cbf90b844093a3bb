"""Requests the kube-apiserver served, from its own ``/metrics`` (``apiserver_request_total``).

The operator's tests and ``bench/bench_operator.py`` count what a quiet
cluster costs: take `request_counts` before and after a window and
subtract (`delta`).
"""

from __future__ import annotations

import re
import ssl
import urllib.request
from collections import Counter
from pathlib import Path

# (verb, resource, subresource), e.g. ("PATCH", "speculativepairs", "status").
RequestKey = tuple[str, str, str]

_SAMPLE = re.compile(r"^apiserver_request_total\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_request_totals(text: str) -> Counter[RequestKey]:
    """``apiserver_request_total`` summed over codes, scopes and the rest, by request key."""
    totals: Counter[RequestKey] = Counter()
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        labels = dict(_LABEL.findall(match.group("labels")))
        key = (labels.get("verb", ""), labels.get("resource", ""), labels.get("subresource", ""))
        totals[key] += int(float(match.group("value")))
    return totals


def request_counts(server_url: str, token: str, ca_path: Path) -> Counter[RequestKey]:
    request = urllib.request.Request(
        f"{server_url}/metrics", headers={"Authorization": f"Bearer {token}"}
    )
    context = ssl.create_default_context(cafile=str(ca_path))
    with urllib.request.urlopen(request, context=context, timeout=30) as reply:
        return parse_request_totals(reply.read().decode())


def delta(after: Counter[RequestKey], before: Counter[RequestKey]) -> Counter[RequestKey]:
    """The requests between two readings (zero entries dropped)."""
    return Counter({k: after[k] - before.get(k, 0) for k in after if after[k] > before.get(k, 0)})
