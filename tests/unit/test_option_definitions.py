"""Every serving option is defined once: the runtime config, the CRD and the engine agree."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specpair_operator.api import RUNTIME_SERVING_OPTIONS, ServingSpec
from specpair_runtime.config import SERVING_OPTIONS, STEP_TOKENS_START, Option, ServingOptions
from specpair_runtime.engine.options import EngineOptions

# Bounds the CRD sets beyond the option's own, and why: the pod runs as a non-root user.
CRD_ONLY_BOUNDS = {"port": {"ge": 1024}}
# EngineOptions' names for the serving options it takes.
ENGINE_FIELDS = {
    "max_batch_size": "max_slots",
    "max_model_length": "max_length",
    "max_step_tokens": "max_step_tokens",
    "cuda_graphs": "cuda_graphs",
    "cuda_graph_compile": "cuda_graph_compile",
    "prefill_order": "prefill_order",
    "prefix_reuse": "prefix_reuse",
}


def bounds(metadata: list[object]) -> dict[str, object]:
    found: dict[str, object] = {}
    for item in metadata:
        for name in ("ge", "gt", "le"):
            if getattr(item, name, None) is not None:
                found[name] = getattr(item, name)
    return found


@pytest.mark.parametrize("name", sorted(SERVING_OPTIONS))
def test_the_runtime_config_and_the_crd_read_one_definition(name: str) -> None:
    option = SERVING_OPTIONS[name]
    runtime = ServingOptions.model_fields[name]
    crd = ServingSpec.model_fields[name]
    assert runtime.default == (None if option.per_device else option.default)
    assert bounds(runtime.metadata) == dict(option.bounds)
    assert bounds(crd.metadata) == {**option.bounds, **CRD_ONLY_BOUNDS.get(name, {})}
    assert runtime.description is not None and crd.description is not None
    assert runtime.description.startswith(option.description)
    assert crd.description.startswith(option.description)
    if name in RUNTIME_SERVING_OPTIONS:  # unset in the CRD: the runtime's default applies
        assert crd.default is None
        assert crd.description.endswith(f"Unset: {option.default_text()}.")
    else:
        assert crd.default == option.default


@pytest.mark.parametrize(("name", "engine_field"), sorted(ENGINE_FIELDS.items()))
def test_the_engine_defaults_are_the_servers(name: str, engine_field: str) -> None:
    option = SERVING_OPTIONS[name]
    engine = {f.name: f.default for f in dataclasses.fields(EngineOptions)}
    assert engine[engine_field] == (None if option.per_device else option.default)
    serving = EngineOptions.from_serving(ServingOptions())
    assert getattr(serving, engine_field) == getattr(EngineOptions(), engine_field)


def test_a_per_device_default_is_what_the_engine_starts_from() -> None:
    for device, start in STEP_TOKENS_START.items():
        budget = EngineOptions().step_budget(
            torch.device(device, 0) if device == "cuda" else torch.device(device)
        )
        assert budget.tokens == start and not budget.fixed


def test_an_option_says_what_unset_means() -> None:
    option = Option(
        "Does a thing.", per_device={"cpu": 1, "cuda": 2}, unset="1 on the CPU, 2 on CUDA"
    )
    assert option.for_device(None, "cuda") == 2 and option.for_device(5, "cuda") == 5
    assert option.for_device(None, "mps") is None
    described = Option("Waits.", 2.0).field(optional=True).description
    assert described == "Waits. Unset: 2."
    assert Option("Waits.", 2.0).field().description == "Waits."
