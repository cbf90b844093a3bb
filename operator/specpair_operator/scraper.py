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
from specpair_operator.api import SpecError, SpeculativePairSpec, parse_spec
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
        anchors.samples = acceptance.keep_only(
            anchors.samples, [p["metadata"]["name"] for p in ready]
        )
        if not samples:
            return None
        patch = self._patch(pair, spec, status, anchors, samples, now or datetime.now(UTC))
        if patch is None:
            return None
        written = self.kube.merge_patch(
            pair_path(pair.namespace, pair.name) + "/status", {"status": patch}
        )
        self.store.put(PAIR, written)
        return patch

    def _patch(
        self,
        pair: PairRef,
        spec: SpeculativePairSpec,
        status: dict[str, Any],
        anchors: PairAnchors,
        samples: dict[str, PodSample],
        now: datetime,
    ) -> dict[str, Any] | None:
        """The status patch of this scrape, or None when nothing new is known.

        An interval is published once it holds ``minDraftedTokens`` drafted
        tokens; it then sets the revision's baseline if it has none, and the
        next interval starts. Before that, only a change in which pods do not
        speculate is published (the runtime's own fallback shows at once),
        with the numbers of the interval so far.
        """
        current = anchors.revision
        drift = spec.acceptance_drift
        win = acceptance.window(anchors.samples, samples)
        off = [
            {"pod": pod, "reason": reason}
            for pod, reason in acceptance.speculation_off(samples, anchors.samples)
        ]
        previous = status.get("acceptance")
        history = status.get("revisions") or []
        baseline = (find(history, current) or {}).get("baselineRate")
        if acceptance.settled(win, drift.min_drafted_tokens):
            patch: dict[str, Any] = {}
            if baseline is None:
                updated = with_baseline(history, current, win.rate)
                if updated is not None:
                    patch["revisions"] = updated
                    log.info(f"{pair.namespace}/{pair.name}: baseline of {current} {win.rate:.3f}")
            drifted = acceptance.drifted(win.rate, baseline, drift.tolerance)
            patch["acceptance"] = _published(win, current, len(samples), drifted, off, now)
            anchors.samples = dict(samples)
            return patch
        if (previous or {}).get("speculationOff", []) == off:
            return None  # the interval grows until it holds enough drafted tokens
        if previous is not None and previous.get("revision") == current:
            return {"acceptance": {**previous, "speculationOff": off}}
        return {"acceptance": _published(win, current, len(samples), False, off, now)}


def _published(
    win: acceptance.Window,
    revision: str,
    pods: int,
    drift: bool,
    off: list[dict[str, str]],
    now: datetime,
) -> dict[str, Any]:
    """``status.acceptance`` for an interval."""
    share = win.speculated_share
    published: dict[str, Any] = {
        "rate": round(win.rate, 4),
        "meanAcceptedLength": round(win.mean_accepted_length, 4),
        "draftedTokens": win.drafted,
        "generatedTokens": win.generated,
        "speculatedShare": None if share is None else round(share, 4),
        "observedTime": rfc3339(now),
        "revision": revision,
        "pods": pods,
        "drift": drift,
        "speculationOff": off,
    }
    if win.per_position:
        published["perPosition"] = win.position_rates
    return published
