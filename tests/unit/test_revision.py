"""The revision hash moves with the models and the image, not with replicas or knobs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from specpair_operator.api import SpeculativePairSpec, parse_spec
from specpair_operator.revision import compute_revision

ROOT = Path(__file__).resolve().parents[2]
BASE: dict[str, Any] = yaml.safe_load((ROOT / "crds/samples/gpu-pair.yaml").read_text())["spec"]


def spec_with(path: str, value: object) -> SpeculativePairSpec:
    data = yaml.safe_load(yaml.safe_dump(BASE))
    node = data
    *parents, leaf = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return parse_spec(data)


BASE_REVISION = compute_revision(parse_spec(BASE), draft_loaded=True)


def test_revision_is_stable_and_short() -> None:
    again = compute_revision(parse_spec(yaml.safe_load(yaml.safe_dump(BASE))), draft_loaded=True)
    assert again == BASE_REVISION
    assert len(BASE_REVISION) == 10 and all(c in "0123456789abcdef" for c in BASE_REVISION)


def test_defaults_written_out_do_not_change_it() -> None:
    # The apiserver fills in defaults; the hash must not see a difference.
    assert compute_revision(spec_with("target.quantization", "none"), draft_loaded=True) == (
        BASE_REVISION
    )


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("replicas", 7),
        ("speculation.maxDepth", 8),
        ("speculation.enabled", False),
        ("speculation.acceptanceFloor", 0.5),
        ("resources.cpu", "16"),
        ("resources.gpuMemory", "80Gi"),
        ("scheduling.nodeSelector", {"pool": "a100"}),
        ("rollout.maxSurge", 2),
        ("target.size.parameters", 8_000_000_000),
    ],
)
def test_fields_outside_the_revision(path: str, value: object) -> None:
    assert compute_revision(spec_with(path, value), draft_loaded=True) == BASE_REVISION


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("version", "2024-08-a"),
        ("target.source", "hf://meta-llama/Llama-3.1-8B"),
        ("target.revision", "deadbeef"),
        ("draft.source", "hf://meta-llama/Llama-3.2-3B-Instruct"),
        ("draft.revision", "cafebabe"),
        ("draft.dtype", "float16"),
        ("runtimeImage", "ghcr.io/specpair/runtime:0.2.0"),
        ("serving.maxModelLength", 8192),
        ("serving.maxStepTokens", 64),
        ("serving.cudaGraphs", True),
        ("serving.cudaGraphCompile", True),
        ("serving.prefillOrder", "arrival"),
        ("serving.prefixReuse", False),
        ("serving.cpuThreads", 1),
        ("serving.drainTimeoutSeconds", 30),
        ("serving.outputFilter", {"denyPatterns": ["x"]}),
        ("goldenPrompts.nearTieMargin", 0.5),
        ("goldenPrompts", {"configMapRef": {"name": "golden"}}),
    ],
)
def test_fields_in_the_revision(path: str, value: object) -> None:
    assert compute_revision(spec_with(path, value), draft_loaded=True) != BASE_REVISION


def test_unset_optional_fields_keep_existing_revisions() -> None:
    # The sample's revision before serving options and nearTieMargin entered the CRD: an
    # operator upgrade must not roll the pods of pairs that do not set them.
    assert BASE_REVISION == "852e23c6e6"


def test_dropping_the_draft_is_a_new_revision() -> None:
    assert compute_revision(parse_spec(BASE), draft_loaded=False) != BASE_REVISION
