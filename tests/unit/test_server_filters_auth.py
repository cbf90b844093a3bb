"""Output filter construction and the Bearer key check."""

from __future__ import annotations

from pathlib import Path

import pytest

from specpair_runtime.config import ConfigError, OutputFilter
from specpair_runtime.server.auth import authorized, load_api_key
from specpair_runtime.server.filters import build_filter


def test_deny_list_matches_across_chunks_of_verified_text() -> None:
    output_filter = build_filter(OutputFilter(deny_patterns=[r"pass\s*word", "SECRET"]))
    assert output_filter.check("my pass") is None
    # The filter sees the whole released text, so a match spanning chunks is found.
    assert output_filter.check("my pass word") is not None
    assert "SECRET" in (output_filter.check("a SECRET b") or "")


def test_no_patterns_means_no_filter() -> None:
    assert build_filter(None).check("anything") is None
    assert build_filter(OutputFilter()).check("anything") is None


def test_bad_regex_names_its_field() -> None:
    with pytest.raises(ConfigError, match=r"serving\.outputFilter\.denyPatterns\[1\]"):
        build_filter(OutputFilter(deny_patterns=["ok", "(unclosed"]))


def test_bearer_key(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("  k3y\n")
    key = load_api_key(key_file)
    assert key == "k3y"
    assert authorized("Bearer k3y", key) and authorized("bearer k3y", key)
    assert not authorized(None, key)
    assert not authorized("Bearer k3", key)
    assert not authorized("Basic k3y", key)
    assert not authorized("k3y", key)
    assert authorized(None, None)
    key_file.write_text("\n")
    with pytest.raises(ConfigError, match="apiKeyFile"):
        load_api_key(key_file)
