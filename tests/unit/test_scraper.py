"""What one scrape publishes in status.acceptance (operator/specpair_operator/scraper.py)."""

from __future__ import annotations

from datetime import UTC, datetime

from kubernetes import client

from specpair_operator.acceptance import PodSample
from specpair_operator.api import parse_spec
from specpair_operator.builders import PairRef
from specpair_operator.kube import Kube
from specpair_operator.scraper import PairAnchors, Scraper
from specpair_operator.store import Store
from tests.support.operator_process import SAMPLE

NOW = datetime(2026, 1, 1, tzinfo=UTC)
PAIR = PairRef("chat", "ns", "uid-1")
SPEC = parse_spec({**SAMPLE["spec"], "acceptanceDrift": {"minDraftedTokens": 100}})


def scraper() -> Scraper:
    return Scraper(Kube(client.ApiClient()), Store())  # _patch sends nothing


def test_a_full_interval_is_published_with_its_share_and_starts_the_next() -> None:
    anchors = PairAnchors("r1")
    samples = {"p": PodSample(drafted=120, accepted=60, steps=30, generated=150)}
    status = {"currentRevision": "r1", "revisions": [{"revision": "r1", "version": "v"}]}
    patch = scraper()._patch(PAIR, SPEC, status, anchors, samples, NOW)
    assert patch is not None
    published = patch["acceptance"]
    assert (published["rate"], published["draftedTokens"], published["generatedTokens"]) == (
        0.5,
        120,
        150,
    )
    assert published["speculatedShare"] == 0.6  # (30 steps + 60 accepted) / 150
    assert patch["revisions"][0]["baselineRate"] == 0.5
    assert anchors.samples == samples  # the next interval starts here


def test_the_runtime_falling_back_is_published_before_a_full_interval() -> None:
    anchors = PairAnchors("r1")
    off = PodSample(
        drafted=32, accepted=0, steps=8, generated=40, speculating=False,
        fallbacks={"acceptance_floor": 1.0},
    )  # fmt: skip
    status = {"currentRevision": "r1"}
    patch = scraper()._patch(PAIR, SPEC, status, anchors, {"p": off}, NOW)
    assert patch is not None
    published = patch["acceptance"]
    assert published["speculationOff"] == [{"pod": "p", "reason": "acceptance_floor"}]
    assert (published["draftedTokens"], published["revision"], published["drift"]) == (
        32,
        "r1",
        False,
    )
    assert anchors.samples == {}  # the interval keeps growing
    # Nothing new: nothing to write.
    again = scraper()._patch(PAIR, SPEC, {**status, **patch}, anchors, {"p": off}, NOW)
    assert again is None
