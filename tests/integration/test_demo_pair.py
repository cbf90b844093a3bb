"""The demo pair of the CPU image (`make images`), served as its pod would serve it.

tools/make_demo_models.py builds the tiny pair that the CPU image bakes in
and rewrites the CPU sample to use it. Here the operator's own builders turn
that sample into the runtime config its ConfigMap would carry, and the real
`specpair-runtime serve` answers a completion with it, on loopback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from tools import make_demo_models

from specpair_operator import builders
from specpair_operator.api import parse_spec
from specpair_operator.headroom import device_memory, plan_for_spec
from specpair_runtime.config import dump_runtime_config
from tests.support.server_harness import free_port, subprocess_server, wait_until_ready

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parent.parent.parent
SAMPLE = ROOT / "crds" / "samples" / "cpu-pair.yaml"


def demo_pair(models: Path) -> dict[str, Any]:
    sizes = make_demo_models.build(models)
    sample = yaml.safe_load(SAMPLE.read_text())
    return make_demo_models.demo_sample(sample, sizes, models, "example.test/runtime:cpu")


def test_demo_sample_plans_colocated_in_a_laptop_pod(tmp_path: Path) -> None:
    pair = demo_pair(tmp_path / "models")
    spec = parse_spec(pair["spec"])
    assert spec.runtime_image == "example.test/runtime:cpu"
    assert spec.target.source == str(tmp_path / "models" / "target")
    device = device_memory(spec)
    assert device is not None
    assert plan_for_spec(spec, device).mode == "Colocated"
    for role in ("target", "draft"):
        assert (tmp_path / "models" / role / "config.json").is_file()
        assert pair["spec"][role]["size"]["parameters"] > 0


def test_demo_pair_serves_a_completion(tmp_path: Path) -> None:
    pair = demo_pair(tmp_path / "models")
    spec = parse_spec(pair["spec"])
    ref = builders.PairRef(pair["metadata"]["name"], "default", "uid-1")
    config = builders.runtime_config(ref, spec, speculate=True)
    # The pod binds 0.0.0.0 on its own IP; a test binds loopback only.
    config = config.model_copy(
        update={
            "serving": config.serving.model_copy(update={"host": "127.0.0.1", "port": free_port()})
        }
    )
    config_path = tmp_path / "runtime.yaml"
    config_path.write_text(dump_runtime_config(config))

    with subprocess_server(config_path, tmp_path / "runtime.log") as server:
        ready = wait_until_ready(server.base_url)
        assert ready["phase"] == "ready", server.log()[-3000:]
        (model,) = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"]
        assert model["pair"] == ref.name and model["pair_version"] == spec.version
        reply = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": model["id"], "prompt": "Hello, how can I help", "max_tokens": 8},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] > 0
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        assert f'specpair_speculation_enabled{{pair="{ref.name}"' in metrics
