"""The CRD's CEL rules, evaluated with cel-python (the v1.20 apiserver ignores them).

Each case also goes through the operator's Python mirror of the rules
(`SpeculativePairSpec`), so the two cannot drift apart.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from celpy.adapter import json_to_cel

from specpair_operator import crd
from specpair_operator.api import SpecError, parse_spec

ROOT = Path(__file__).resolve().parents[2]
GOOD: dict[str, Any] = yaml.safe_load((ROOT / "crds/samples/gpu-pair.yaml").read_text())["spec"]


def rules_by_path() -> list[tuple[str, str, str]]:
    found: list[tuple[str, str, str]] = []

    def visit(node: dict[str, Any], path: str) -> None:
        for rule in node.get("x-kubernetes-validations", []):
            found.append((path, rule["rule"], rule["message"]))
        for name, child in (node.get("properties") or {}).items():
            visit(child, f"{path}.{name}" if path else name)

    root = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    visit(root["properties"]["spec"], "spec")
    return found


def cel_violations(spec: dict[str, Any]) -> list[str]:
    """Messages of the rules that fail; a rule applies only where its object is present."""
    env = celpy.Environment()
    failed = []
    for path, rule, message in rules_by_path():
        node: Any = spec
        for part in path.split(".")[1:]:
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            continue
        program = env.program(env.compile(rule))
        if not bool(program.evaluate({"self": json_to_cel(node)})):
            failed.append(message)
    return failed


def mutated(**paths: Any) -> dict[str, Any]:
    spec = copy.deepcopy(GOOD)
    for dotted, value in paths.items():
        node = spec
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return spec


def test_there_are_rules() -> None:
    assert len(rules_by_path()) >= 4


def test_good_sample_passes() -> None:
    assert cel_violations(GOOD) == []
    parse_spec(GOOD)


def test_cpu_sample_passes() -> None:
    cpu = yaml.safe_load((ROOT / "crds/samples/cpu-pair.yaml").read_text())["spec"]
    assert cel_violations(cpu) == []


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (mutated(draft__source=GOOD["target"]["source"]), "draft.source must differ"),
        (mutated(speculation__minDepth=6, speculation__maxDepth=3), "minDepth must be <="),
        (mutated(target__quantization="int8-dynamic"), "target.quantization must be 'none'"),
        (
            mutated(
                goldenPrompts={
                    "inline": GOOD["goldenPrompts"]["inline"],
                    "configMapRef": {"name": "g"},
                }
            ),
            "exactly one of inline or configMapRef",
        ),
        (mutated(goldenPrompts={}), "exactly one of inline or configMapRef"),
        (mutated(resources__gpus=0, resources__gpuMemory="80Gi"), "gpuMemory needs"),
    ],
)
def test_bad_objects_fail_in_cel_and_in_python(spec: dict[str, Any], message: str) -> None:
    violations = cel_violations(spec)
    assert len(violations) == 1 and message in violations[0], violations
    with pytest.raises(SpecError):
        parse_spec(spec)


def test_rules_tolerate_absent_optional_fields() -> None:
    # minDepth left out (the apiserver defaults it; a pre-default object lacks it).
    spec = mutated()
    spec["speculation"] = {"maxDepth": 2}
    assert cel_violations(spec) == []
