"""The termination message the runtime writes (the real kubelet reads it in tests/e2e)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specpair_runtime import termination


def test_writes_the_message_into_the_existing_file(tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    log.write_text("stale text from an earlier run that is longer")
    assert termination.write_termination_message("  config invalid: serving.port  \n", log)
    assert log.read_text() == "config invalid: serving.port"


def test_the_path_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "log"
    log.touch()
    monkeypatch.setenv(termination.PATH_ENV, str(log))
    assert termination.termination_log_path() == log
    assert termination.write_termination_message("why")
    assert log.read_text() == "why"
    monkeypatch.delenv(termination.PATH_ENV)
    assert termination.termination_log_path() == Path("/dev/termination-log")


def test_never_fails_and_never_creates_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir" / "termination-log"
    assert termination.write_termination_message("why", missing) is False
    assert not (tmp_path / "absent").exists()
    assert termination.write_termination_message("why", tmp_path / "absent") is False
    assert not (tmp_path / "absent").exists()
    assert termination.write_termination_message("why", tmp_path) is False  # a directory


def test_long_messages_are_cut_to_what_the_kubelet_keeps() -> None:
    clipped = termination.clip("é" * 5000)
    assert len(clipped) <= termination.MAX_BYTES
    assert clipped.endswith(b"...")
    clipped.decode()  # never cut inside a character
