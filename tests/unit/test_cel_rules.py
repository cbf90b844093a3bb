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
from specpair_operator.api import SpecError, parse_pair, parse_spec

ROOT = Path(__file__).resolve().parents[2]
GOOD: dict[str, Any] = yaml.safe_load((ROOT / "crds/samples/gpu-pair.yaml").read_text())["spec"]


def rules_by_path() -> list[tuple[str, str, str]]:
    """(path, rule, message); "" is the object itself, ``name[]`` each item of an array."""
    found: list[tuple[str, str, str]] = []

    def visit(node: dict[str, Any], path: str) -> None:
        for rule in node.get("x-kubernetes-validations", []):
            found.append((path, rule["rule"], rule["message"]))
        for name, child in (node.get("properties") or {}).items():
            visit(child, f"{path}.{name}" if path else name)
        if "items" in node:
            visit(node["items"], f"{path}[]")

    visit(crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"], "")
    return found


def nodes_at(obj: Any, path: str) -> list[Any]:
    """The values a rule at ``path`` applies to (none where an optional field is absent)."""
    found = [obj]
    for part in filter(None, path.split(".")):
        key = part.removesuffix("[]")
        found = [n.get(key) for n in found if isinstance(n, dict) and n.get(key) is not None]
        if part.endswith("[]"):
            found = [item for n in found for item in n]
    return found


def cel_violations(spec: dict[str, Any], name: str = "llama-8b-1b") -> list[str]:
    """Messages of the rules that fail on a pair named ``name`` with ``spec``."""
    env = celpy.Environment()
    obj = {"metadata": {"name": name}, "spec": spec}
    failed = []
    for path, rule, message in rules_by_path():
        program = env.program(env.compile(rule))
        for node in nodes_at(obj, path):
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
        (
            mutated(goldenPrompts={"configMapRef": {"name": "g"}, "nearTieMargin": 0.5}),
            "nearTieMargin applies to inline prompts only",
        ),
        (mutated(resources__gpus=0, resources__gpuMemory="80Gi"), "gpuMemory needs"),
        (mutated(resources__gpus=2), "resources.gpus must be 0 or 1: the runtime serves"),
        (
            mutated(scheduling__tolerations=[{"key": "k", "operator": "Exists", "value": "v"}]),
            "operator Exists must not have a value",
        ),
        (
            mutated(scheduling__tolerations=[{"operator": "Equal", "value": "v"}]),
            "without a key needs operator Exists",
        ),
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


def test_inline_prompts_take_a_near_tie_margin() -> None:
    spec = mutated(goldenPrompts__nearTieMargin=0.25)
    assert cel_violations(spec) == []
    assert parse_spec(spec).golden_prompts is not None


@pytest.mark.parametrize(
    "name",
    [
        "a" * 64,  # a label value holds at most 63 characters
        "pair.v2",  # a dot: not a Service name (DNS-1035 label)
        "2pair",  # a Service name starts with a letter
        "Pair",
    ],
)
def test_bad_names_fail_in_cel_and_in_python(name: str) -> None:
    violations = cel_violations(GOOD, name=name)
    assert len(violations) == 1 and "metadata.name must be a DNS-1035 label" in violations[0]
    with pytest.raises(SpecError, match=r"^metadata\.name: "):
        parse_pair({"metadata": {"name": name}, "spec": GOOD})


def test_longest_name_passes() -> None:
    assert cel_violations(GOOD, name="a" * 63) == []
    parse_pair({"metadata": {"name": "a" * 63}, "spec": GOOD})
