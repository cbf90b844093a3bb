"""The termination message: the runtime writes it; the kubelet (played by the harness) reads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from specpair_runtime import termination
from tests.support.fake_kubelet import termination_message


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


# The kubelet's rules (pkg/kubelet/kuberuntime: the file first; the log tail only as a
# fallback, only under FallbackToLogsOnError and only after a failed exit).
def test_the_file_wins_under_both_policies() -> None:
    for policy in ("File", "FallbackToLogsOnError"):
        assert termination_message("bad config", policy, 1, "log line") == "bad config"


def test_the_log_tail_only_under_fallback_after_a_failed_exit() -> None:
    log = "".join(f"line {i}\n" for i in range(100))
    tail = termination_message("", "FallbackToLogsOnError", 2, log)
    assert tail.startswith("line 20\n") and tail.endswith("line 99\n")  # the last 80 lines
    assert termination_message("", "File", 2, log) == ""
    assert termination_message("", "FallbackToLogsOnError", 0, log) == ""


def test_the_kubelet_limits() -> None:
    assert len(termination_message("x" * 10000, "File", 1, "")) == 4096
    tail = termination_message("", "FallbackToLogsOnError", 1, "y" * 10000 + "\n")
    assert len(tail.encode()) == 2048
