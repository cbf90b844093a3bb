"""Live knob reload through the watched config file, including an invalid file."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support.server_harness import (
    eventually,
    in_process_server,
    metric_value,
    save_tiny_pair,
    write_config,
)

pytestmark = pytest.mark.integration

PROMPT = "Please share your order number"


def complete(base_url: str) -> dict[str, Any]:
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    payload: dict[str, Any] = response.json()
    return payload


def edit(path: Path, **sections: dict[str, Any]) -> None:
    data = yaml.safe_load(path.read_text())
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def test_knobs_reload_live_and_an_invalid_file_keeps_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="specpair")
    pair = save_tiny_pair(tmp_path / "pair")
    config = write_config(tmp_path / "config.yaml", *pair, speculation={"enabled": True})
    with in_process_server(config, watch_interval=0.1) as server:
        url = server.base_url
        baseline = complete(url)
        assert baseline["speculation"]["drafted"] > 0

        edit(config, speculation={"enabled": False})

        def off() -> None:
            assert complete(url)["speculation"]["drafted"] == 0

        eventually(off)
        assert "speculation knobs reloaded" in caplog.text
        assert metric_value(httpx.get(f"{url}/metrics").text, "specpair_speculation_enabled") == 0

        # Invalid: rejected with a log line naming the field, knobs stay off.
        good_text = config.read_text()
        config.write_text(good_text.replace("enabled: false", "enabled: false\n  maxDepth: 99"))
        # Wait for this file's rejection: an earlier poll may have read the first
        # edit half-written (write_text truncates first) and logged a rejection too.
        eventually(lambda: _assert_in("speculation.maxDepth", caplog.text))
        assert "config reload rejected" in caplog.text
        off()

        # A model change needs a restart: logged, not applied.
        config.write_text(good_text)  # back to a valid file first
        edit(config, draft={"source": str(tmp_path / "elsewhere")}, speculation={"enabled": True})
        eventually(lambda: _assert_in("restart required", caplog.text))
        assert "draft" in caplog.text

        # ...while the knob change in the same file applies.
        eventually(lambda: _assert_positive(complete(url)["speculation"]["drafted"]))
        assert metric_value(httpx.get(f"{url}/metrics").text, "specpair_speculation_enabled") == 1


def _assert_in(needle: str, haystack: str) -> None:
    assert needle in haystack


def _assert_positive(value: int) -> None:
    assert value > 0
