"""The committed CRD is the generated one, structural, and fully described."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from specpair_operator import api, crd

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "crds" / "specpair.dev_speculativepairs.yaml"


def schema() -> dict[str, Any]:
    crd_obj = crd.build_crd()
    openapi: dict[str, Any] = crd_obj["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return openapi


def walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path or "(root)", node
    for name, child in (node.get("properties") or {}).items():
        yield from walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


def test_committed_crd_matches_generated() -> None:
    assert COMMITTED.read_text() == crd.render_crd(), (
        "crds/specpair.dev_speculativepairs.yaml is stale: run `make crds`"
    )


def test_every_field_has_a_description() -> None:
    for path, node in walk(schema()):
        if path.endswith("[]") or path.endswith("{}") or path == ".metadata":
            continue  # items of a described list/map; metadata may only have a type
        assert node.get("description"), f"{path} has no description"


def test_schema_is_structural() -> None:
    forbidden = {"$ref", "anyOf", "oneOf", "allOf", "title", "$defs", "const"}
    for path, node in walk(schema()):
        assert not forbidden & set(node), f"{path}: {sorted(forbidden & set(node))}"
        assert "type" in node, f"{path} has no type"
        if "properties" in node:
            assert "additionalProperties" not in node, path
        for flag in ("exclusiveMinimum", "exclusiveMaximum"):
            assert isinstance(node.get(flag, True), bool), f"{path}.{flag} must be a bool"


def test_names_columns_and_subresource() -> None:
    spec = crd.build_crd()["spec"]
    assert spec["group"] == "specpair.dev"
    assert spec["names"]["kind"] == "SpeculativePair"
    assert spec["names"]["shortNames"] == ["spair"]
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1" and version["storage"]
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Version", "Serving", "Mode", "Ready", "Acceptance", "Age"]


def test_defaults_enums_and_ranges() -> None:
    props = schema()["properties"]["spec"]["properties"]
    assert props["replicas"]["default"] == 1 and props["replicas"]["minimum"] == 0
    assert props["target"]["properties"]["dtype"]["enum"] == [
        "auto",
        "float32",
        "float16",
        "bfloat16",
    ]
    spec_knobs = props["speculation"]
    assert spec_knobs["default"] == {}  # so that the nested defaults apply
    assert spec_knobs["properties"]["maxDepth"] == {
        "default": 4,
        "description": "Max tokens drafted per step.",
        "maximum": 16,
        "minimum": 1,
        "type": "integer",
    }
    headroom = props["resources"]["properties"]["headroomFraction"]
    assert (headroom["maximum"], headroom["exclusiveMaximum"]) == (1.0, True)
    assert props["target"]["properties"]["size"]["properties"]["parameters"]["format"] == "int64"
    affinity = props["scheduling"]["properties"]["affinity"]
    assert affinity["x-kubernetes-preserve-unknown-fields"] is True
    # Optional objects whose absence means something get no {} default.
    assert "default" not in props["goldenPrompts"]


def test_cel_rules_are_attached() -> None:
    spec = schema()["properties"]["spec"]
    rules = [r["rule"] for r in spec["x-kubernetes-validations"]]
    assert "self.draft.source != self.target.source" in rules
    knobs = spec["properties"]["speculation"]["x-kubernetes-validations"]
    assert "self.minDepth <= self.maxDepth" in knobs[0]["rule"]


def test_crd_validates_against_the_kubernetes_schema() -> None:
    kubernetes_validate.validate(yaml.safe_load(COMMITTED.read_text()), "1.27.0", strict=True)


def test_issue_11_bounds_are_in_the_schema() -> None:
    """What every apiserver refuses at apply time (items 4, 5 and 9 of issue 11)."""
    root = schema()
    name_rule = root["x-kubernetes-validations"][0]
    assert "self.metadata.name" in name_rule["rule"] and "63" in name_rule["rule"]
    spec = root["properties"]["spec"]["properties"]
    resources = spec["resources"]["properties"]
    # More than one GPU only with engine vllm: a CEL rule on spec, since a bound cannot
    # depend on another field.
    assert (
        resources["gpus"]["maximum"] == api.MAX_GPUS
        and "one GPU" in resources["gpus"]["description"]
    )
    gpus_rule = next(
        r
        for r in root["properties"]["spec"]["x-kubernetes-validations"]
        if "resources.gpus <= 1" in r["rule"]
    )
    assert "engine == 'vllm'" in gpus_rule["rule"] and "engine: vllm" in gpus_rule["message"]
    for field in ("gpuMemory", "memory"):
        assert resources[field]["pattern"] == api.BYTES_PATTERN
    assert spec["target"]["properties"]["size"]["properties"]["parameters"]["maximum"] == 10**15
    inline = spec["goldenPrompts"]["properties"]["inline"]
    assert inline["maxItems"] == api.MAX_INLINE_GOLDEN_PROMPTS
    assert "configMapRef" in inline["description"]
    prompt = inline["items"]["properties"]["prompt"]
    assert prompt["maxLength"] == api.MAX_GOLDEN_PROMPT_LENGTH
    tolerations = spec["scheduling"]["properties"]["tolerations"]
    assert (
        tolerations["maxItems"] == 64 and len(tolerations["items"]["x-kubernetes-validations"]) == 2
    )


def test_serving_options_have_int64_safe_bounds_and_no_defaults() -> None:
    """Unset runtime options must stay unset (the runtime's default), so no CRD default."""
    spec = schema()["properties"]["spec"]["properties"]
    serving = spec["serving"]["properties"]
    assert (serving["maxStepTokens"]["minimum"], serving["maxStepTokens"]["maximum"]) == (
        1,
        1048576,
    )
    body = serving["maxRequestBodyBytes"]
    assert (body["minimum"], body["maximum"]) == (1024, api.MAX_REQUEST_BODY_BYTES)
    assert body["maximum"] < 2**31  # fits int32, so no int64 format needed
    for name in ("headerTimeoutSeconds", "bodyTimeoutSeconds", "drainTimeoutSeconds"):
        timeout = serving[name]
        assert timeout["type"] == "number" and timeout["exclusiveMinimum"] is True, name
        assert (timeout["minimum"], timeout["maximum"]) == (0.0, 3600.0), name
    assert serving["cudaGraphs"]["type"] == "boolean"
    assert (serving["cpuThreads"]["minimum"], serving["cpuThreads"]["maximum"]) == (1, 1024)
    patterns = serving["outputFilter"]["properties"]["denyPatterns"]
    assert patterns["maxItems"] == api.MAX_DENY_PATTERNS
    assert patterns["items"]["maxLength"] == api.MAX_DENY_PATTERN_LENGTH
    for field in api.RUNTIME_SERVING_OPTIONS:
        alias = api.ServingSpec.model_fields[field].alias
        assert alias is not None and "default" not in serving[alias], field
    assert "YAML mapping `keys:`" in serving["apiKeySecret"]["description"]
    margin = spec["goldenPrompts"]["properties"]["nearTieMargin"]
    assert (margin["minimum"], margin["maximum"]) == (0.0, api.MAX_NEAR_TIE_MARGIN)
    assert "default" not in margin
