"""A grammar compiles off the event loop and the engine thread: a slow one stalls nobody else.

An in-process server whose grammar compiler is held inside one compile:
meanwhile another request is served whole, and the held one finishes once
the compile does. A second request with the same grammar finds it cached.
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from specpair_runtime.engine.grammar import CompiledGrammar, GrammarSpec
from tests.support.server_harness import in_process_server, write_config

pytestmark = [pytest.mark.integration]


def test_a_slow_compile_stalls_no_other_request(pair: tuple[Path, Path], tmp_path: Path) -> None:
    config = write_config(tmp_path / "config.yaml", *pair)
    with in_process_server(config) as server:
        compiler = server.state.grammars
        assert compiler is not None
        release = threading.Event()
        entered = threading.Event()
        build = compiler._build

        def held(spec: GrammarSpec) -> CompiledGrammar:
            if spec.kind == "regex":
                entered.set()
                release.wait(120)
            return build(spec)

        compiler._build = held  # type: ignore[method-assign]
        url = f"{server.base_url}/v1/completions"
        constrained = {"prompt": "Order:", "max_tokens": 12, "temperature": 0,
                       "guided_regex": "[A-Z]{2}-[0-9]{3}"}  # fmt: skip
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(httpx.post, url, json=constrained, timeout=180)
            assert entered.wait(60)
            plain = httpx.post(
                url, json={"prompt": "Hello", "max_tokens": 8, "temperature": 0}, timeout=60
            )
            assert plain.status_code == 200 and not waiting.done()
            release.set()
            response = waiting.result(timeout=180)
        assert response.status_code == 200, response.text
        assert re.fullmatch("[A-Z]{2}-[0-9]{3}", response.json()["choices"][0]["text"])
        compiles = compiler.compiles
        again = httpx.post(url, json=constrained, timeout=60)
        assert again.json()["choices"][0]["text"] == response.json()["choices"][0]["text"]
        assert compiler.compiles == compiles  # cached: no second compile
