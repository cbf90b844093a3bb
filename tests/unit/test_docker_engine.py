"""The project's Docker daemon and its runc wrapper, as pure functions (no Docker here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tools import docker_engine, runc_oom_clamp

DAEMON = docker_engine.ProjectDaemon(Path("/cache/docker"))


def test_the_daemon_keeps_its_data_in_the_cache_and_owns_no_network() -> None:
    argv = docker_engine.daemon_argv("/usr/sbin/dockerd", DAEMON, clamp_oom=False)
    assert "--data-root=/cache/docker/data" in argv
    assert f"--host=unix://{docker_engine.EXEC_ROOT}/docker.sock" in argv
    # Builds run with --network=none; pods get the node's CNI: no bridge, no rules.
    for flag in ("--bridge=none", "--iptables=false", "--ip-masq=false", "--ip-forward=false"):
        assert flag in argv
    assert not any(a.startswith("--default-runtime") for a in argv)


def test_without_cap_sys_resource_runc_runs_behind_the_clamp() -> None:
    argv = docker_engine.daemon_argv("/usr/sbin/dockerd", DAEMON, clamp_oom=True)
    name = docker_engine.CLAMP_RUNTIME
    assert f"--add-runtime={name}=/cache/docker/runc-oom-clamp" in argv
    assert f"--default-runtime={name}" in argv


def test_the_clamp_finds_the_bundle_of_create_and_run_only() -> None:
    create = ["--root", "/r", "--log", "/l", "create", "--bundle", "/b/1", "--pid-file", "p", "id"]
    assert runc_oom_clamp.bundle_of(create) == Path("/b/1")
    assert runc_oom_clamp.bundle_of(["run", "--bundle=/b/2", "id"]) == Path("/b/2")
    assert runc_oom_clamp.bundle_of(["--root", "/r", "start", "id"]) is None
    assert runc_oom_clamp.bundle_of(["state", "id"]) is None


def test_the_clamp_raises_only_what_is_below_the_floor() -> None:
    low = {"process": {"oomScoreAdj": -998, "args": ["/pause"]}}
    assert runc_oom_clamp.clamp(low, 0) and low["process"]["oomScoreAdj"] == 0
    high = {"process": {"oomScoreAdj": 1000}}
    assert not runc_oom_clamp.clamp(high, 0) and high["process"]["oomScoreAdj"] == 1000
    assert not runc_oom_clamp.clamp({"process": {}}, 0)
    assert not runc_oom_clamp.clamp({}, 0)


def test_the_clamp_edits_the_bundle_then_hands_over_to_runc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"process": {"oomScoreAdj": -997}, "root": {"path": "rootfs"}}))
    ran: list[list[str]] = []
    monkeypatch.setattr(runc_oom_clamp, "own_floor", lambda: 0)
    monkeypatch.setattr("os.execvp", lambda f, a: ran.append(a))
    runc_oom_clamp.main(["create", "--bundle", str(tmp_path), "c1"])
    assert json.loads(config.read_text())["process"]["oomScoreAdj"] == 0
    assert ran == [[runc_oom_clamp.RUNC, "create", "--bundle", str(tmp_path), "c1"]]
