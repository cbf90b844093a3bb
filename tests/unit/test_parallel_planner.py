"""vLLM's layout in the planner (`plan_parallel`), with the arithmetic done by hand.

Llama-3.1-70B (70_553_706_496 parameters, 80 layers, 8 KV heads, head_dim
128) drafted by Llama-3.2-1B (1_235_814_400, 16 layers, 8 KV heads, 64), in
bf16, batch 16 × 8192 tokens, depth 4, on GPUs of 80 GiB with 10 % headroom.

Per GPU at tensor parallelism 4 (the draft sharded alike):

- target weights: 70_553_706_496 × 2 / 4 = 35_276_853_248
- target KV: 2 × 80 × (8 / 4) × 128 × 2 = 81_920 B/token;
  tokens 16 × (8192 + 4 lookahead) = 131_136 → 10_742_661_120
- draft weights: 1_235_814_400 × 2 / 4 = 617_907_200
- draft KV: 2 × 16 × 2 × 64 × 2 = 8_192 B/token → 1_074_266_112
- reserve: 1 GiB context + 2 GiB activations + 1 GiB graphs + 1/4 GiB draft
  = 4_563_402_752
- total 52_275_090_432; usable 85_899_345_920 − 8_589_934_592 = 77_309_411_328.

At TP 2 the target's weights alone (70_553_706_496) and its KV leave no room.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from specpair_runtime.planner import (
    GIB,
    ModelGeometry,
    ParallelRequest,
    plan_parallel,
    smallest_tensor_parallel_size,
    tensor_parallel_problem,
)

LLAMA_70B = ModelGeometry(70_553_706_496, 80, 8, 128, dtype="bfloat16")
LLAMA_405B = ModelGeometry(405_853_388_800, 126, 8, 128, dtype="bfloat16")
LLAMA_1B = ModelGeometry(1_235_814_400, 16, 8, 64, dtype="bfloat16")
REQUEST = ParallelRequest(
    tensor_parallel_size=4,
    draft_tensor_parallel_size=4,
    max_batch_size=16,
    max_model_length=8192,
    device_bytes=80 * GIB,
)


def test_a_70b_target_needs_four_gpus_of_80_gib() -> None:
    plan = plan_parallel(LLAMA_70B, LLAMA_1B, REQUEST)
    assert plan.mode == "Colocated"
    assert plan.target.weights_bytes == 35_276_853_248
    assert plan.target.kv_cache_bytes == 10_742_661_120
    assert plan.draft.weights_bytes == 617_907_200
    assert plan.draft.kv_cache_bytes == 1_074_266_112
    assert plan.overhead_bytes == 4_563_402_752
    assert plan.required_bytes == 52_275_090_432
    assert plan.reason.startswith("target and draft fit with TP 4: need 48.68 GiB of 72.00 GiB")
    parallel = plan.parallel
    assert parallel is not None
    assert (parallel.tensor_parallel_size, parallel.nodes, parallel.gpus_per_node) == (4, 1, 4)
    assert parallel.smallest_tensor_parallel_size == 4
    assert parallel.gpu_memory_utilization == 0.9
    assert parallel.layout == "SingleNode"


def test_two_gpus_are_refused_with_the_numbers_and_the_fix() -> None:
    plan = plan_parallel(LLAMA_70B, LLAMA_1B, replace(REQUEST, tensor_parallel_size=2))
    assert plan.mode == "DoesNotFit"
    assert plan.reason.startswith("target needs ")
    assert "with TP 2" in plan.reason and "72.00 GiB usable per GPU" in plan.reason
    assert plan.reason.endswith("the pair fits with its draft on 4 GPUs (resources.gpus: 4)")
    assert plan.required_bytes > 72 * GIB


def test_smallest_tensor_parallel_size_is_a_power_of_two_that_fits() -> None:
    assert smallest_tensor_parallel_size(LLAMA_70B, LLAMA_1B, REQUEST) == 4
    small = replace(REQUEST, device_bytes=24 * GIB)
    assert smallest_tensor_parallel_size(LLAMA_70B, LLAMA_1B, small) == 16
    tiny = replace(REQUEST, device_bytes=1 * GIB)
    assert smallest_tensor_parallel_size(LLAMA_70B, LLAMA_1B, tiny) is None
    plan = plan_parallel(LLAMA_70B, LLAMA_1B, replace(tiny, tensor_parallel_size=64))
    assert plan.mode == "DoesNotFit"
    assert plan.reason.endswith("it does not fit with its draft on up to 64 such GPUs")


def test_more_gpus_than_kv_heads_keep_one_head_per_gpu() -> None:
    request = replace(REQUEST, tensor_parallel_size=16, draft_tensor_parallel_size=16)
    plan = plan_parallel(LLAMA_70B, LLAMA_1B, request)
    # 8 KV heads over 16 GPUs: each keeps one (vLLM replicates them), not half of one.
    assert plan.target.kv_cache_bytes == 2 * 80 * 1 * 128 * 2 * 131_136
    assert plan.target.weights_bytes == 70_553_706_496 * 2 // 16


def test_kv_heads_that_do_not_split_are_refused() -> None:
    assert tensor_parallel_problem(LLAMA_70B, 3, "target") == (
        "the target's 8 KV heads cannot be split over 3 GPUs: one must divide the other"
    )
    plan = plan_parallel(LLAMA_70B, LLAMA_1B, replace(REQUEST, tensor_parallel_size=3))
    assert plan.mode == "DoesNotFit" and "cannot be split over 3 GPUs" in plan.reason


def test_past_one_node_the_layout_is_a_group_of_nodes_never_pipeline_stages() -> None:
    request = replace(
        REQUEST,
        tensor_parallel_size=16,
        draft_tensor_parallel_size=16,
        max_batch_size=32,
        gpus_per_node=8,
        speculative_tokens=3,
    )
    plan = plan_parallel(LLAMA_405B, LLAMA_1B, request)
    assert plan.mode == "Colocated"
    parallel = plan.parallel
    assert parallel is not None
    assert (parallel.nodes, parallel.gpus_per_node, parallel.layout) == (2, 8, "MultiNode")
    assert "TP 16 over 2 nodes of 8 GPUs" in plan.reason
    # 8 GPUs alone would not hold the 405B target: it needs the second node.
    assert parallel.smallest_tensor_parallel_size == 16


def test_gpus_that_do_not_spread_evenly_over_nodes_are_refused() -> None:
    request = replace(REQUEST, tensor_parallel_size=12, gpus_per_node=8)
    four_heads = ModelGeometry(70_553_706_496, 80, 4, 128, dtype="bfloat16")
    plan = plan_parallel(four_heads, ModelGeometry(1_000_000, 4, 4, 64, "bfloat16"), request)
    assert plan.mode == "DoesNotFit"
    assert "12 GPUs cannot be spread evenly over nodes of 8 GPUs" in plan.reason


def test_a_draft_that_does_not_fit_leaves_the_target_alone() -> None:
    huge_draft = ModelGeometry(60_000_000_000, 80, 8, 128, dtype="bfloat16")
    plan = plan_parallel(LLAMA_70B, huge_draft, REQUEST)
    assert plan.mode == "TargetOnly"
    assert "speculation is off" in plan.reason


def test_the_cpu_layout_has_one_node_and_no_gpu_memory_utilization() -> None:
    tiny_target = ModelGeometry(200_000, 2, 2, 32, dtype="float32")
    request = replace(
        REQUEST,
        tensor_parallel_size=1,
        draft_tensor_parallel_size=1,
        max_batch_size=4,
        max_model_length=256,
        device_bytes=4 * GIB,
        cuda=False,
    )
    plan = plan_parallel(tiny_target, tiny_target, request)
    assert plan.mode == "Colocated" and "in the pod" in plan.reason
    assert plan.parallel is not None and plan.parallel.nodes == 1


@pytest.mark.parametrize("bad", [{"max_batch_size": 0}, {"headroom_fraction": 1.0}])
def test_bad_requests_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        plan_parallel(LLAMA_70B, LLAMA_1B, replace(REQUEST, **bad))  # type: ignore[arg-type]
