"""Generate docs/api.md, the SpeculativePair reference, from the CRD's schema.

    python -m tools.gen_api_docs           # write docs/api.md
    python -m tools.gen_api_docs --check   # exit 1 when docs/api.md is stale

The CRD itself is generated from the operator's pydantic models (`make crds`),
so this page follows the models with no hand-written field lists.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from specpair_runtime.engine.api import SEED_GUARANTEE

ROOT = Path(__file__).resolve().parent.parent
CRD_PATH = ROOT / "crds" / "specpair.dev_speculativepairs.yaml"
DOC_PATH = ROOT / "docs" / "api.md"

Schema = dict[str, Any]


def _cell(text: str) -> str:
    """One Markdown table cell: no newlines, no unescaped pipes."""
    return " ".join(text.split()).replace("|", "\\|")


def _type(schema: Schema) -> str:
    if schema.get("x-kubernetes-int-or-string"):
        return "int or string"
    kind = str(schema.get("type", "any"))
    if kind == "array":
        return f"[]{_type(schema.get('items', {}))}"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"map[string]{_type(schema['additionalProperties'])}"
    if kind == "integer" and schema.get("format"):
        return f"integer ({schema['format']})"
    return kind


def _constraints(schema: Schema) -> str:
    parts: list[str] = []
    if "enum" in schema:
        parts.append("one of " + ", ".join(f"`{v}`" for v in schema["enum"]))
    # OpenAPI v3.0: exclusiveMinimum/exclusiveMaximum are flags on minimum/maximum.
    for key, label in (
        ("minimum", ">" if schema.get("exclusiveMinimum") else ">="),
        ("maximum", "<" if schema.get("exclusiveMaximum") else "<="),
        ("minLength", "min length"),
        ("maxLength", "max length"),
        ("minItems", "min items"),
        ("maxItems", "max items"),
    ):
        if key in schema:
            parts.append(f"{label} {schema[key]}")
    if "pattern" in schema:
        parts.append(f"pattern `{schema['pattern']}`")
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        parts.append("free-form")
    return "; ".join(parts)


def _default(schema: Schema) -> str:
    if "default" not in schema:
        return ""
    return f"`{json.dumps(schema['default'], sort_keys=True)}`"


def _object_of(schema: Schema) -> Schema | None:
    """The object schema under a field (itself, or its array's items), if it has fields."""
    inner = schema.get("items", {}) if schema.get("type") == "array" else schema
    return inner if isinstance(inner, dict) and inner.get("properties") else None


def _sections(path: str, schema: Schema) -> Iterator[tuple[str, Schema]]:
    """(path, object schema) for every object with fields, parents before children."""
    yield path, schema
    for name, child in schema.get("properties", {}).items():
        inner = _object_of(child)
        if inner is not None:
            suffix = "[]" if child.get("type") == "array" else ""
            yield from _sections(f"{path}.{name}{suffix}", inner)


def _rules(schema: Schema) -> list[str]:
    return [
        f"- `{rule['rule']}`: {rule.get('message', '')}".rstrip(": ")
        for rule in schema.get("x-kubernetes-validations", [])
    ]


def _section(path: str, schema: Schema) -> list[str]:
    lines = [f"### `{path}`", ""]
    if schema.get("description"):
        lines += [_cell(str(schema["description"])), ""]
    required = set(schema.get("required", []))
    lines += [
        "| Field | Type | Required | Default | Constraints | Description |",
        "|---|---|---|---|---|---|",
    ]
    for name, child in schema.get("properties", {}).items():
        field = f"[`{name}`](#{_anchor(f'{path}.{name}')})" if _object_of(child) else f"`{name}`"
        lines.append(
            "| "
            + " | ".join(
                [
                    field,
                    _cell(_type(child)),
                    "yes" if name in required else "",
                    _cell(_default(child)),
                    _cell(_constraints(child)),
                    _cell(str(child.get("description", ""))),
                ]
            )
            + " |"
        )
    rules = _rules(schema)
    if rules:
        lines += ["", "Validation rules (CEL, checked by Kubernetes 1.25 and newer):", "", *rules]
    return [*lines, ""]


def _anchor(path: str) -> str:
    """GitHub's anchor of the heading `path` (dots and the brackets of arrays drop out)."""
    return "".join(c for c in path.lower() if c.isalnum() or c in "-_")


def render(crd: dict[str, Any]) -> str:
    """The Markdown reference of a CRD (its first served version)."""
    spec = crd["spec"]
    version = next(v for v in spec["versions"] if v.get("served"))
    names = spec["names"]
    schema = version["schema"]["openAPIV3Schema"]
    lines = [
        f"# {names['kind']} API reference",
        "",
        "<!-- Generated by `python -m tools.gen_api_docs` from "
        "crds/specpair.dev_speculativepairs.yaml. Do not edit by hand:",
        "     tests/unit/test_api_docs.py fails when this page is stale. -->",
        "",
        f"- Group: `{spec['group']}`, version `{version['name']}`, "
        f"kind `{names['kind']}` (`kubectl get {names['plural']}`, short names "
        + ", ".join(f"`{s}`" for s in names.get("shortNames", []))
        + ")",
        f"- Scope: {spec['scope']}"
        + (", with a `status` subresource" if "status" in version.get("subresources", {}) else ""),
        "",
        _cell(str(schema.get("description", ""))),
        "",
        "## `kubectl get` columns",
        "",
        "| Column | Type | From | Description |",
        "|---|---|---|---|",
    ]
    for column in version.get("additionalPrinterColumns", []):
        lines.append(
            f"| {column['name']} | {column['type']} | `{_cell(column['jsonPath'])}` | "
            f"{_cell(str(column.get('description', '')))} |"
        )
    root_rules = _rules(schema)
    if root_rules:
        lines += [
            "",
            "## Object rules",
            "",
            "Validation rules on the whole object (CEL, checked by Kubernetes 1.25 and newer; "
            "the operator checks them too and reports a violation as `Degraded=InvalidSpec`):",
            "",
            *root_rules,
        ]
    lines += ["", "## Fields", ""]
    properties = schema.get("properties", {})
    for top in ("spec", "status"):
        if top in properties:
            for path, section in _sections(top, properties[top]):
                lines += _section(path, section)
    lines += _server_requests()
    return "\n".join(lines).rstrip() + "\n"


def _server_requests() -> list[str]:
    """What the runtime's OpenAI-compatible server guarantees beyond OpenAI's reference."""
    return [
        "",
        "## Server requests",
        "",
        "The runtime's OpenAI-compatible API (`/v1/completions`, `/v1/chat/completions`): "
        "where it promises more than OpenAI's API reference.",
        "",
        "### `seed`",
        "",
        SEED_GUARANTEE,
    ]


def load_crd(path: Path = CRD_PATH) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or data.get("kind") != "CustomResourceDefinition":
        raise ValueError(f"{path}: not a CustomResourceDefinition")
    return data


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="Exit 1 when docs/api.md is stale.")
    args = parser.parse_args(argv)
    text = render(load_crd())
    if args.check:
        if not DOC_PATH.is_file() or DOC_PATH.read_text() != text:
            print(f"{DOC_PATH.relative_to(ROOT)} is stale; run `make crds`", file=sys.stderr)
            return 1
        print(f"{DOC_PATH.relative_to(ROOT)} is up to date")
        return 0
    DOC_PATH.parent.mkdir(parents=True, exist_ok=True)
    DOC_PATH.write_text(text)
    print(f"wrote {DOC_PATH.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
