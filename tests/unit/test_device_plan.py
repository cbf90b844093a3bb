"""The start-up device plan: the operator's planner fed with measured device memory."""

from __future__ import annotations

import math

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from tools.tiny_models import as_loaded, build_pair

from specpair_runtime.config import ServingOptions, SpeculationKnobs
from specpair_runtime.engine.device_plan import (
    HEADROOM_FRACTION,
    DeviceMemory,
    decide,
    drop_draft,
    geometry,
    plan_for_pair,
    plan_on_device,
)
from specpair_runtime.engine.pair import LoadedPair, check_pair
from specpair_runtime.planner import GIB, ModelGeometry, plan
from specpair_runtime.server.startup import apply_device_plan
from specpair_runtime.server.state import ServerState
from tests.support.server_harness import bare_server_state

# The Qwen2.5-Coder 1.5B target and 0.5B draft in bf16: parameter counts of the
# model cards; layers, KV heads and head size of their config.json.
TARGET = ModelGeometry(1_543_714_304, layers=28, kv_heads=2, head_dim=128, dtype="bfloat16")
DRAFT = ModelGeometry(494_032_768, layers=24, kv_heads=2, head_dim=64, dtype="bfloat16")
SERVING: dict[str, int] = {"max_batch_size": 8, "max_model_length": 2048}


def test_a_roomy_gpu_keeps_the_draft() -> None:
    result = decide(TARGET, DRAFT, memory=DeviceMemory(70 * GIB, 80 * GIB, 4 * GIB), **SERVING)
    assert result.mode == "Colocated" and result.speculate
    assert result.reason == (
        "target and draft fit: need 5.67 GiB of 66.60 GiB usable (74.00 GiB less 10% headroom); "
        "measured 70.00 GiB free of 80.00 GiB, 4.00 GiB held by the loaded models"
    )


def test_it_is_the_operators_planner_on_free_plus_held_memory() -> None:
    memory = DeviceMemory(free_bytes=3 * GIB, total_bytes=24 * GIB, held_bytes=4 * GIB)
    result = decide(TARGET, DRAFT, memory=memory, **SERVING)
    assert result.plan == plan(
        TARGET,
        DRAFT,
        max_batch_size=8,
        max_model_length=2048,
        device_bytes=7 * GIB,
        headroom_fraction=HEADROOM_FRACTION,
        cuda=True,
    )


def test_a_draft_that_does_not_fit_beside_the_target_and_its_kv_means_target_only() -> None:
    # The pair needs 5.67 GiB, the target alone 4.31 GiB; 6 GiB less 10 % is 5.4 GiB.
    result = decide(TARGET, DRAFT, memory=DeviceMemory(2 * GIB, 24 * GIB, 4 * GIB), **SERVING)
    assert result.mode == "TargetOnly" and not result.speculate
    assert result.reason == (
        "target-only: draft needs 0.27 GiB more: the pair needs 5.67 GiB but only 5.40 GiB "
        "usable (6.00 GiB less 10% headroom); speculation is off; "
        "measured 2.00 GiB free of 24.00 GiB, 4.00 GiB held by the loaded models"
    )
    # More KV (longer requests) pushes a pair that fits out of the device.
    fits = DeviceMemory(3 * GIB, 24 * GIB, 4 * GIB)
    assert decide(TARGET, DRAFT, memory=fits, **SERVING).speculate
    longer = decide(TARGET, DRAFT, memory=fits, max_batch_size=8, max_model_length=8192)
    assert longer.mode == "TargetOnly"


def test_a_target_that_does_not_fit_still_serves_target_only_and_says_so() -> None:
    result = decide(TARGET, DRAFT, memory=DeviceMemory(GIB, 24 * GIB, 2 * GIB), **SERVING)
    assert result.mode == "DoesNotFit" and not result.speculate
    assert result.reason.startswith(
        "target-only, and even that may run out of memory: target needs 1.61 GiB more: "
        "it alone needs 4.31 GiB but only 2.70 GiB usable"
    )


def test_the_boundary_is_exact_to_the_byte() -> None:
    need = decide(TARGET, DRAFT, memory=DeviceMemory(70 * GIB, 80 * GIB, 0), **SERVING)
    required = need.plan.required_bytes
    # Smallest device whose usable part (less a rounded-up 10 %) holds the pair.
    device = int(required / (1 - HEADROOM_FRACTION)) - 64
    while device - math.ceil(device * HEADROOM_FRACTION) < required:  # the planner's rule
        device += 1
    at = decide(TARGET, DRAFT, memory=DeviceMemory(device - GIB, 80 * GIB, GIB), **SERVING)
    below = decide(TARGET, DRAFT, memory=DeviceMemory(device - GIB - 1, 80 * GIB, GIB), **SERVING)
    assert (at.mode, below.mode) == ("Colocated", "TargetOnly")


def test_device_memory_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="free_bytes must be >= 0, got -1"):
        DeviceMemory(-1, GIB, 0)
    with pytest.raises(ValueError, match="total_bytes must be >= 1, got 0"):
        DeviceMemory(0, 0, 0)


def tiny(kind: str = "llama") -> LoadedPair:
    pair = build_pair(kind)  # type: ignore[arg-type]
    target = as_loaded(pair.target, pair.tokenizer, "target")
    draft = as_loaded(pair.draft, pair.tokenizer, "draft")
    return LoadedPair(target, draft, check_pair(target, draft), SpeculationKnobs())


def test_geometry_comes_from_the_loaded_models() -> None:
    llama, gpt2 = tiny("llama"), tiny("gpt2")
    got = geometry(llama.target)
    parameters = sum(p.numel() for p in llama.target.model.parameters())
    assert got == ModelGeometry(parameters, layers=2, kv_heads=2, head_dim=16, dtype="float32")
    assert geometry(gpt2.target).kv_heads == 4  # GPT-2 has no GQA: one KV head per head
    assert geometry(gpt2.target).head_dim == 16


def test_a_pair_that_does_not_fit_drops_its_draft_and_decodes_target_only() -> None:
    pair = tiny()
    serving = ServingOptions(max_batch_size=4, max_model_length=512)
    # The tiny pair needs its weights and KV plus the planner's fixed 1.25 GiB overhead.
    roomy = plan_for_pair(pair, serving, DeviceMemory(2 * GIB, 8 * GIB, 0))
    assert roomy.speculate
    short = int(1.3 * GIB)
    tight = plan_for_pair(pair, serving, DeviceMemory(short, 8 * GIB, 0))
    assert tight.mode == "TargetOnly", tight.reason
    drop_draft(pair)
    assert pair.draft is None and pair.speculation_refused == "no draft model loaded"
    assert not pair.engine().speculation_active
    with pytest.raises(ValueError, match="needs a pair with a draft"):
        plan_for_pair(pair, serving, DeviceMemory(short, 8 * GIB, 0))


def test_no_plan_on_the_cpu() -> None:
    assert plan_on_device(tiny(), ServingOptions()) is None


@pytest.mark.cuda
def test_plan_on_a_real_cuda_device() -> None:
    pair = tiny()
    for model in (pair.target, pair.draft):
        assert model is not None
        model.model.to("cuda")
        object.__setattr__(model, "device", torch.device("cuda"))
    result = plan_on_device(pair, ServingOptions())
    assert result is not None and result.speculate, result
    _free, total = torch.cuda.mem_get_info()
    assert result.memory.total_bytes == total
    assert result.memory.held_bytes > 0  # the tiny weights sit in the caching allocator


def plan_modes(state: ServerState) -> dict[str, float]:
    """The ``specpair_device_plan`` gauge's value per ``mode`` label, as exported."""
    text = state.metrics.render().decode()
    return {
        sample.labels["mode"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "specpair_device_plan"
        for sample in family.samples
    }


def test_the_startup_hook_changes_nothing_on_the_cpu() -> None:
    pair, state = tiny(), bare_server_state({})
    assert apply_device_plan(state, pair) is None
    assert pair.draft is not None and plan_modes(state) == {}


@pytest.mark.cuda
def test_the_startup_hook_drops_a_draft_that_does_not_fit_on_this_gpu() -> None:
    pair = tiny()
    for model in (pair.target, pair.draft):
        assert model is not None
        model.model.to("cuda")
        object.__setattr__(model, "device", torch.device("cuda"))
    assert pair.draft is not None
    free, _total = torch.cuda.mem_get_info()
    usable = (free + torch.cuda.memory_reserved()) * (1 - HEADROOM_FRACTION)
    target = geometry(pair.target)
    per_token = 2 * target.layers * target.kv_heads * target.head_dim * 4  # fp32 K and V
    # Tokens that leave the target (and 1 GiB overhead) 0.1 GiB short of the usable
    # memory: the draft's equal KV cannot fit beside it. Only planned, never allocated.
    tokens = int((usable - 1.1 * GIB - target.parameters * 4) // per_token)
    state = bare_server_state({"maxBatchSize": 1, "maxModelLength": tokens})
    reason = apply_device_plan(state, pair)
    assert reason is not None and reason.startswith("target-only: draft needs "), reason
    assert pair.draft is None and not pair.engine().speculation_active
    assert plan_modes(state) == {"Colocated": 0.0, "TargetOnly": 1.0, "DoesNotFit": 0.0}
