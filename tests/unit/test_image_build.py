"""What `make images` hashes and fetches, without Docker (tools/images.py and friends).

A cached `make images` is only as right as its hash: it must change when
anything an image is built from changes, and stay when nothing does.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from tools import base_image, images, wheelhouse
from tools.build_support import BuildError

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheelhouse_holds_the_pinned_extra_and_what_builds_the_project() -> None:
    runtime = wheelhouse.requirements("runtime")
    assert "torch==2.13.0" in runtime and "setuptools>=69" in runtime
    operator = wheelhouse.requirements("operator")
    assert not any(r.startswith("torch") for r in operator)
    with pytest.raises(BuildError, match="no extra 'gpu'"):
        wheelhouse.requirements("gpu")


def test_the_wheelhouse_key_follows_the_pins(tmp_path: Path) -> None:
    project = tmp_path / "pyproject.toml"
    text = (ROOT / "pyproject.toml").read_text()
    project.write_text(text)
    first = wheelhouse.requirements("operator", project)
    project.write_text(text.replace('"kopf==1.45.2"', '"kopf==1.45.3"'))
    assert wheelhouse.requirements("operator", project) != first
    _, one = wheelhouse.plan("operator", tmp_path)
    _, again = wheelhouse.plan("operator", tmp_path)
    assert one == again and one.path.parent == tmp_path / "wheelhouse"


def copy_sources(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for source in images.OPERATOR.sources:
        target = root / source
        if (ROOT / source).is_dir():
            shutil.copytree(ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / source, target)
    shutil.copytree(ROOT / "operator", root / "operator", dirs_exist_ok=True)
    return root


def test_the_inputs_hash_changes_with_a_source_and_only_then(tmp_path: Path) -> None:
    root = copy_sources(tmp_path)
    house = wheelhouse.Wheelhouse(tmp_path / "wh", "k1")

    def digest(key: str = "k1", base: str = "sha256:b") -> str:
        files = images.source_files(root, images.OPERATOR.sources)
        house_key = wheelhouse.Wheelhouse(house.path, key)
        return images.inputs_hash(root, images.OPERATOR, files, house_key, base)

    first = digest()
    assert digest() == first
    # Caches, compiled files and Dockerfiles are not inputs.
    (root / "runtime" / "specpair_runtime" / "__pycache__").mkdir(exist_ok=True)
    (root / "runtime" / "specpair_runtime" / "__pycache__" / "x.pyc").write_bytes(b"x")
    (root / "runtime" / "Dockerfile.cpu").write_text("# changed")
    assert digest() == first
    # A source, the wheelhouse or the base image: a new hash each.
    config = root / "runtime" / "specpair_runtime" / "config.py"
    config.write_text(config.read_text() + "\n# changed\n")
    changed = digest()
    assert changed != first
    assert len({changed, digest(key="k2"), digest(base="sha256:c")}) == 3


def test_a_missing_source_names_itself(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="operator"):
        images.source_files(tmp_path, ("operator",))


def test_the_base_image_is_named_by_its_recipe() -> None:
    recipe = base_image.BaseRecipe("http://deb.debian.org/debian")
    assert recipe.image().startswith("specpair/base:bookworm-")
    assert "python3" in recipe.packages and "python3-venv" in recipe.packages
    other = base_image.BaseRecipe(recipe.mirror, packages=(*recipe.packages, "curl"))
    assert other.key() != recipe.key()
    assert base_image.BaseRecipe(recipe.mirror).key() == recipe.key()
