"""docs/api.md is the CRD reference generated from the CRD's schema, and current."""

from __future__ import annotations

import copy

from tools import gen_api_docs


def test_api_docs_are_current() -> None:
    expected = gen_api_docs.render(gen_api_docs.load_crd())
    assert gen_api_docs.DOC_PATH.read_text() == expected, (
        "docs/api.md is stale: run `make crds` (or python -m tools.gen_api_docs)"
    )


def test_every_spec_field_is_documented() -> None:
    crd = gen_api_docs.load_crd()
    text = gen_api_docs.render(crd)
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for top in ("spec", "status"):
        for name in schema["properties"][top]["properties"]:
            assert f"`{name}`" in text, f"{top}.{name} is missing from docs/api.md"
    for column in crd["spec"]["versions"][0]["additionalPrinterColumns"]:
        assert f"| {column['name']} |" in text


def test_a_schema_change_changes_the_page() -> None:
    crd = gen_api_docs.load_crd()
    changed = copy.deepcopy(crd)
    spec = changed["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["replicas"]["description"] = "A | new description."
    text = gen_api_docs.render(changed)
    assert text != gen_api_docs.render(crd)
    assert "A \\| new description." in text
