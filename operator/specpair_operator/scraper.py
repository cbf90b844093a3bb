"""Scrape the pods' ``/metrics`` into ``status.acceptance`` and the revision baseline.

Free of kopf: the controller runs `Scraper.scrape` from a plain thread every
``SPECPAIR_SCRAPE_SECONDS``. Only the ready pods of the current revision
count; they come from the watched store, so only the pods' own ``/metrics``
and a changed status cost requests. The math is in `acceptance.py`; this
module does the I/O and keeps the per-pod anchors between scrapes (in
memory: after an operator restart the first interval counts from each pod's
start, which is still real data).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from specpair_operator import acceptance, pods
from specpair_operator.acceptance import PodSample
from specpair_operator.api import SpecError, parse_spec
from specpair_operator.builders import REVISION_LABEL, PairRef
from specpair_operator.conditions import rfc3339
from specpair_operator.engines.lws import is_leader
from specpair_operator.history import find, with_baseline
from specpair_operator.kube import Kube, pair_path
from specpair_operator.store import PAIR, POD, Store

log = logging.getLogger("specpair.scraper")

ATTEMPTS = 2
RETRY_DELAY_SECONDS = 0.5

Fetch = Callable[[str], tuple[int, str] | None]


@dataclass
class PairAnchors:
    revision: str
    samples: dict[str, PodSample] = field(default_factory=dict)


@dataclass
class Scraper:
    """Anchors per pair uid; `scrape` returns the status patch it wrote (or None)."""

    kube: Kube
    store: Store
    fetch: Fetch = pods.fetch
    anchors: dict[str, PairAnchors] = field(default_factory=dict)

    def _sample(self, pod: dict[str, Any]) -> PodSample | None:
        base = pods.metrics_endpoint(pod)
        if base is None:
            return None
        name = pod["metadata"]["name"]
        for attempt in range(ATTEMPTS):
            reply = self.fetch(f"{base}/metrics")
            if reply is not None and reply[0] == 200:
                return acceptance.parse_metrics(reply[1])
            what = "unreachable" if reply is None else f"HTTP {reply[0]}"
            log.warning(f"scrape {name} ({base}/metrics): {what}, attempt {attempt + 1}")
            if attempt + 1 < ATTEMPTS:
                time.sleep(RETRY_DELAY_SECONDS)
        return None

    def scrape(self, body: dict[str, Any], *, now: datetime | None = None) -> dict[str, Any] | None:
        """One scrape of one pair; writes ``status.acceptance`` when it changed."""
        now = now or datetime.now(UTC)
        pair = PairRef.from_body(body)
        status: dict[str, Any] = dict(body.get("status") or {})
        current = status.get("currentRevision")
        try:
            spec = parse_spec(body.get("spec"))
        except SpecError:
            return None
        if not current:
            return None
        selector = {"app.kubernetes.io/instance": pair.name, REVISION_LABEL: current}
        found = self.store.select(POD, pair.namespace, selector)
        # A LeaderWorkerSet's workers serve no API: its leaders speak for their groups.
        ready = [p for p in found if pods.is_ready(p) and is_leader(p)]
        samples: dict[str, PodSample] = {}
        for pod in ready:
            sample = self._sample(pod)
            if sample is not None:
                samples[pod["metadata"]["name"]] = sample
        anchors = self.anchors.get(pair.uid)
        if anchors is None or anchors.revision != current:
            anchors = self.anchors[pair.uid] = PairAnchors(current)
        # Pods that went away leave the interval; unreachable ones keep their anchor.
        names = [p["metadata"]["name"] for p in ready]
        anchors.samples = acceptance.keep_only(anchors.samples, names)
        if not samples:
            return None
        drift = spec.acceptance_drift
        win = acceptance.window(anchors.samples, samples)
        off = [
            {"pod": pod, "reason": reason}
            for pod, reason in acceptance.speculation_off(samples, anchors.samples)
        ]
        previous = status.get("acceptance")
        patch: dict[str, Any] = {}
        if acceptance.settled(win, drift.min_drafted_tokens):
            history = status.get("revisions") or []
            baseline = (find(history, current) or {}).get("baselineRate")
            if baseline is None:
                updated = with_baseline(history, current, win.rate)
                if updated is not None:
                    patch["revisions"] = updated
                    log.info(f"{pair.namespace}/{pair.name}: baseline of {current} {win.rate:.3f}")
            patch["acceptance"] = {
                "rate": round(win.rate, 4),
                "meanAcceptedLength": round(win.mean_accepted_length, 4),
                "draftedTokens": win.drafted,
                "observedTime": rfc3339(now),
                "revision": current,
                "pods": len(samples),
                "drift": acceptance.drifted(win.rate, baseline, drift.tolerance),
                "speculationOff": off,
            }
            if win.per_position:
                patch["acceptance"]["perPosition"] = win.position_rates
            anchors.samples = dict(samples)
        elif previous is not None and previous.get("speculationOff") != off:
            patch["acceptance"] = {**previous, "speculationOff": off}
        else:
            return None  # the interval grows until it holds enough drafted tokens
        written = self.kube.merge_patch(
            pair_path(pair.namespace, pair.name) + "/status", {"status": patch}
        )
        self.store.put(PAIR, written)
        return patch
