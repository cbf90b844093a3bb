"""Reload diffing and the watcher: knobs apply live, the rest needs a restart."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from specpair_runtime.config import (
    RuntimeConfig,
    SpeculationKnobs,
    dump_runtime_config,
    parse_runtime_config,
)
from specpair_runtime.server.reload import ConfigWatcher, plan_reload

BASE = {
    "pair": {"name": "p", "version": "v1"},
    "target": {"source": "/models/t"},
    "draft": {"source": "/models/d"},
    "speculation": {"maxDepth": 4},
}


def config(**changes: object) -> RuntimeConfig:
    data = {**BASE, **changes}
    return parse_runtime_config(data)


def test_knob_change_only_is_live() -> None:
    plan = plan_reload(config(), config(speculation={"maxDepth": 2, "adaptive": False}))
    assert plan.knobs == SpeculationKnobs(max_depth=2, adaptive=False)
    assert plan.restart_required == ()


def test_model_and_serving_changes_need_a_restart() -> None:
    new = config(draft={"source": "/models/other"}, serving={"maxBatchSize": 2})
    plan = plan_reload(config(), new)
    assert plan.knobs is None
    assert plan.restart_required == ("draft", "serving")


def test_identical_config_plans_nothing() -> None:
    plan = plan_reload(config(), config())
    assert plan.knobs is None and plan.restart_required == ()


def write(path: Path, cfg: RuntimeConfig) -> None:
    path.write_text(dump_runtime_config(cfg))


def test_watcher_applies_rejects_and_follows_a_symlink_swap(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="specpair.reload")
    # ConfigMap layout: the file is a symlink into a directory the kubelet swaps.
    data1 = tmp_path / "..data1"
    data1.mkdir()
    write(data1 / "config.yaml", config())
    link = tmp_path / "config.yaml"
    link.symlink_to(data1 / "config.yaml")
    applied: list[SpeculationKnobs] = []
    watcher = ConfigWatcher(link, config(), applied.append)
    assert watcher.poll_once() is None  # unchanged

    data2 = tmp_path / "..data2"
    data2.mkdir()
    write(data2 / "config.yaml", config(speculation={"maxDepth": 3}, serving={"port": 9000}))
    link.unlink()
    link.symlink_to(data2 / "config.yaml")
    plan = watcher.poll_once()
    assert plan is not None and applied == [SpeculationKnobs(max_depth=3)]
    assert "restart required" in caplog.text and "serving" in caplog.text

    # An invalid file is rejected with a log line naming the field; knobs stay.
    (data2 / "config.yaml").write_text(
        (data2 / "config.yaml").read_text().replace("maxDepth: 3", "maxDepth: 99")
    )
    assert watcher.poll_once() is None
    assert applied == [SpeculationKnobs(max_depth=3)]
    assert "rejected" in caplog.text and "speculation.maxDepth" in caplog.text
    assert watcher.current.speculation.max_depth == 3
    # The old serving section stays in force (it needs a restart).
    assert watcher.current.serving.port == 8000
