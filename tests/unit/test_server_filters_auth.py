"""Output filter construction, the API key file, its rotation and the Bearer check."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from specpair_runtime.config import ConfigError, OutputFilter
from specpair_runtime.server.auth import (
    Caller,
    KeyFileWatcher,
    KeyRing,
    load_key_file,
    parse_key_file,
)
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


def test_one_key_file_is_the_default_key_at_priority_zero(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("  k3y-k3y-k3y\n")
    ring = KeyRing(load_key_file(key_file))
    expected = Caller("default", 0)
    assert ring.caller("Bearer k3y-k3y-k3y") == expected
    assert ring.caller("bearer k3y-k3y-k3y") == expected
    for header in (None, "Bearer k3y-k3y-k3", "Basic k3y-k3y-k3y", "k3y-k3y-k3y"):
        assert ring.caller(header) is None
    key_file.write_text("\n")
    with pytest.raises(ConfigError, match=r"apiKeyFile.*empty"):
        load_key_file(key_file)


KEYS = """
keys:
  - {name: interactive, key: key-interactive-1, priority: 10}
  - {name: batch, key: key-batch-0001, priority: -5}
"""


def test_key_file_maps_keys_to_names_and_priority_classes() -> None:
    ring = KeyRing(parse_key_file(KEYS))
    assert ring.caller("Bearer key-interactive-1") == Caller("interactive", 10)
    assert ring.caller("Bearer key-batch-0001") == Caller("batch", -5)
    assert ring.caller("Bearer key-batch-0002") is None
    assert ring.names == ("interactive", "batch")


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("keys: []", "keys"),
        ("keys:\n  - {name: a, key: short}", "keys.0.key"),
        ("keys:\n  - {name: Has Space, key: long-enough-key}", "keys.0.name"),
        ("keys:\n  - {name: a, key: long-enough-key, priority: 5000}", "keys.0.priority"),
        ("keys:\n  - {name: a, key: long-enough-key, rank: 1}", "keys.0.rank"),
        ("keys:\n  - {name: a, key: long-enough-1}\n  - {name: a, key: long-enough-2}", "unique"),
        ("keys:\n  - {name: a, key: long-enough-1}\n  - {name: b, key: long-enough-1}", "same key"),
        ("two words", "one key"),
    ],
)
def test_bad_key_files_name_the_field_and_never_echo_a_key(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match="apiKeyFile") as error:
        parse_key_file(text)
    assert fragment in str(error.value)
    assert "long-enough" not in str(error.value)


def test_rotation_swaps_keys_and_a_bad_file_keeps_the_old_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("old-key-0001")
    ring = KeyRing(load_key_file(key_file))
    watcher = KeyFileWatcher(key_file, ring)
    assert watcher.poll_once() is False  # unchanged
    key_file.write_text(KEYS)
    with caplog.at_level(logging.INFO, logger="specpair"):
        assert watcher.poll_once() is True
    assert ring.caller("Bearer old-key-0001") is None
    assert ring.caller("Bearer key-batch-0001") == Caller("batch", -5)
    assert "rotated" in caplog.text and "interactive, batch" in caplog.text
    assert "key-batch-0001" not in caplog.text
    key_file.write_text("keys: []")
    assert watcher.poll_once() is False
    assert ring.caller("Bearer key-batch-0001") == Caller("batch", -5)
