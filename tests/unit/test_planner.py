"""The VRAM planner on real model geometries, with the arithmetic done by hand.

Geometries from the models' config.json:

- Llama-3.1-8B: 8_030_261_248 parameters, 32 layers, 8 KV heads, head_dim 128
  (hidden 4096 / 32 attention heads).
- Llama-3.2-1B: 1_235_814_400 parameters, 16 layers, 8 KV heads, head_dim 64
  (hidden 2048 / 32 attention heads).

bfloat16 (2 bytes), max batch 8 × max model length 4096 = 32_768 tokens:

- target weights: 8_030_261_248 × 2 = 16_060_522_496
- target KV: 2 × 32 × 8 × 128 × 2 = 131_072 B/token; × 32_768 = 4_294_967_296 (4 GiB)
- draft weights: 1_235_814_400 × 2 = 2_471_628_800
- draft KV: 2 × 16 × 8 × 64 × 2 = 32_768 B/token; × 32_768 = 1_073_741_824 (1 GiB)
- overhead: 1 GiB runtime (1_073_741_824) + 1/4 GiB with the draft (268_435_456)

- target only: 16_060_522_496 + 4_294_967_296 + 1_073_741_824 = 21_429_231_616
- pair: 21_429_231_616 + 2_471_628_800 + 1_073_741_824 + 268_435_456 = 25_243_037_696
"""

from __future__ import annotations

import pytest

from specpair_runtime.planner import (
    DRAFT_OVERHEAD_BYTES,
    GIB,
    RUNTIME_OVERHEAD_BYTES,
    ModelGeometry,
    estimate,
    plan,
)

LLAMA_31_8B = ModelGeometry(
    parameters=8_030_261_248, layers=32, kv_heads=8, head_dim=128, dtype="bfloat16"
)
LLAMA_32_1B = ModelGeometry(
    parameters=1_235_814_400, layers=16, kv_heads=8, head_dim=64, dtype="bfloat16"
)
TARGET_ONLY = 21_429_231_616
PAIR = 25_243_037_696


def plan_llama(device_gib: int, headroom: float = 0.1):  # type: ignore[no-untyped-def]
    return plan(
        LLAMA_31_8B,
        LLAMA_32_1B,
        max_batch_size=8,
        max_model_length=4096,
        device_bytes=device_gib * GIB,
        headroom_fraction=headroom,
    )


def test_constants_are_what_the_docstring_sums() -> None:
    assert RUNTIME_OVERHEAD_BYTES == 1_073_741_824
    assert DRAFT_OVERHEAD_BYTES == 268_435_456


def test_per_model_breakdown() -> None:
    result = plan_llama(80)
    assert result.target.weights_bytes == 16_060_522_496
    assert result.target.kv_cache_bytes == 4_294_967_296
    assert result.draft.weights_bytes == 2_471_628_800
    assert result.draft.kv_cache_bytes == 1_073_741_824


def test_24gib_is_target_only() -> None:
    # 24 GiB = 25_769_803_776; 10% reserve = ceil(2_576_980_377.6) = 2_576_980_378;
    # usable = 23_192_823_398. The pair (25_243_037_696) does not fit, the target
    # alone (21_429_231_616) does. Missing: 25_243_037_696 - 23_192_823_398
    # = 2_050_214_298 B = 1.909 GiB.
    result = plan_llama(24)
    assert result.mode == "TargetOnly"
    assert result.required_bytes == TARGET_ONLY
    assert result.device_bytes == 25_769_803_776
    assert result.headroom_bytes == 25_769_803_776 - TARGET_ONLY == 4_340_572_160
    assert result.reason.startswith("draft needs 1.91 GiB more")
    assert result.overhead_bytes == RUNTIME_OVERHEAD_BYTES
    assert not result.speculation_possible


def test_40gib_is_colocated() -> None:
    # 40 GiB = 42_949_672_960; reserve 4_294_967_296; usable 38_654_705_664 >= pair.
    result = plan_llama(40)
    assert result.mode == "Colocated"
    assert result.required_bytes == PAIR
    assert result.headroom_bytes == 42_949_672_960 - PAIR == 17_706_635_264
    assert result.overhead_bytes == RUNTIME_OVERHEAD_BYTES + DRAFT_OVERHEAD_BYTES
    assert result.speculation_possible


def test_80gib_is_colocated() -> None:
    result = plan_llama(80)
    assert result.mode == "Colocated"
    assert result.headroom_bytes == 85_899_345_920 - PAIR == 60_656_308_224


def test_16gib_does_not_fit() -> None:
    # 16 GiB = 17_179_869_184; reserve ceil(1_717_986_918.4) = 1_717_986_919;
    # usable 15_461_882_265 < target alone 21_429_231_616: short by
    # 5_967_349_351 B = 5.558 GiB.
    result = plan_llama(16)
    assert result.mode == "DoesNotFit"
    assert result.required_bytes == TARGET_ONLY
    assert result.headroom_bytes == 17_179_869_184 - TARGET_ONLY < 0
    assert result.reason.startswith("target needs 5.56 GiB more")


def test_exact_fit_counts_as_fitting() -> None:
    # No headroom and a device exactly the size of the pair: it fits, 0 bytes left.
    result = plan(
        LLAMA_31_8B,
        LLAMA_32_1B,
        max_batch_size=8,
        max_model_length=4096,
        device_bytes=PAIR,
        headroom_fraction=0.0,
    )
    assert (result.mode, result.headroom_bytes) == ("Colocated", 0)
    one_short = plan(
        LLAMA_31_8B,
        LLAMA_32_1B,
        max_batch_size=8,
        max_model_length=4096,
        device_bytes=PAIR - 1,
        headroom_fraction=0.0,
    )
    assert one_short.mode == "TargetOnly"


def test_kv_cache_scales_with_batch_times_length() -> None:
    small = plan(
        LLAMA_31_8B, LLAMA_32_1B, max_batch_size=1, max_model_length=4096, device_bytes=80 * GIB
    )
    large = plan(
        LLAMA_31_8B, LLAMA_32_1B, max_batch_size=4, max_model_length=8192, device_bytes=80 * GIB
    )
    # 1 × 4096 tokens: 131_072 × 4096 = 512 MiB; 4 × 8192 = 8× that.
    assert small.target.kv_cache_bytes == 536_870_912
    assert large.target.kv_cache_bytes == 8 * 536_870_912


def test_int8_draft_on_cpu() -> None:
    # On the CPU "auto" is float32 (4 bytes); int8-dynamic stores 1 byte per weight
    # but the KV cache stays float32: 2 × 16 × 8 × 64 × 4 = 65_536 B/token.
    draft = ModelGeometry(
        parameters=1_235_814_400, layers=16, kv_heads=8, head_dim=64, quantization="int8-dynamic"
    )
    result = plan(
        LLAMA_31_8B,
        draft,
        max_batch_size=1,
        max_model_length=1024,
        device_bytes=64 * GIB,
        cuda=False,
    )
    assert result.draft.weights_bytes == 1_235_814_400
    assert result.draft.kv_cache_bytes == 65_536 * 1024
    # The target's explicit bfloat16 stays 2 bytes even on the CPU.
    assert result.target.weights_bytes == 16_060_522_496


def test_int4_draft_counts_its_codes_and_the_bf16_copy() -> None:
    # int4-weight holds half a byte of codes and a 2-byte bf16 copy per weight.
    draft = ModelGeometry(
        parameters=1_000_000, layers=16, kv_heads=8, head_dim=64, quantization="int4-weight"
    )
    estimate_int4 = estimate(draft, 1024, cuda=False)
    assert estimate_int4.weights_bytes == 2_500_000
    assert estimate_int4.kv_cache_bytes == 65_536 * 1024  # the KV cache stays float32


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_model_length": 0}, "max_model_length"),
        ({"device_bytes": 0}, "device_bytes"),
        ({"headroom_fraction": 1.0}, "headroom_fraction"),
        ({"headroom_fraction": -0.1}, "headroom_fraction"),
    ],
)
def test_bad_input_names_the_field(kwargs: dict[str, float], field: str) -> None:
    args: dict[str, float] = {"max_batch_size": 1, "max_model_length": 16, "device_bytes": GIB}
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        plan(LLAMA_31_8B, LLAMA_32_1B, **args)  # type: ignore[arg-type]


def test_bad_geometry_names_the_field() -> None:
    with pytest.raises(ValueError, match="kv_heads"):
        ModelGeometry(parameters=1, layers=1, kv_heads=0, head_dim=1)
