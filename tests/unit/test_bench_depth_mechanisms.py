"""bench/bench_depth_mechanisms.py: real engine counts, a modelled clock from a cost table."""

from __future__ import annotations

import pytest
from bench.bench_depth_mechanisms import (
    CostCurve,
    ModelledClock,
    Variant,
    format_table,
    non_decreasing,
    run_variant,
    variants,
)
from tools.tiny_models import as_loaded, build_pair

from specpair_runtime.config import SpeculationKnobs
from specpair_runtime.engine.pair import LoadedPair, check_pair

# A verify costs one step up to 4 tokens, then 0.1 more a token; a draft token 0.2 of it.
COSTS = {
    "target": CostCurve.smooth([1, 4, 8, 64], [1.0, 1.0, 1.4, 7.0]),
    "draft": CostCurve.smooth([1, 64], [0.2, 2.0]),
}


def test_a_cost_table_never_falls_and_is_linear_between_sizes() -> None:
    assert non_decreasing([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert non_decreasing([3.0, 1.0, 2.0]) == [2.0, 2.0, 2.0]
    curve = CostCurve.smooth([4, 1, 8], [1.0, 1.2, 1.4])  # unsorted, 4 timed fast
    assert curve.sizes == (1, 4, 8)
    assert curve.seconds == pytest.approx((1.1, 1.1, 1.4))
    assert curve(6) == pytest.approx(1.25)
    assert curve(16) == pytest.approx(2.0)  # past the last size, the last slope


def test_the_clock_charges_each_forward_its_cost() -> None:
    clock = ModelledClock(COSTS)
    timer = clock.timer()(None)  # type: ignore[arg-type]
    clock.charge("draft", 1)
    timer.mark()
    clock.charge("target", 8)
    assert timer.split() == pytest.approx((0.2, 1.4))
    assert clock.forwards == {"target": 1, "draft": 1}
    assert clock.sizes == {"target": {8: 1}, "draft": {1: 1}}


def tiny_pair() -> LoadedPair:
    tiny = build_pair("llama", seed=0)
    target = as_loaded(tiny.target, tiny.tokenizer, "target")
    draft = as_loaded(tiny.draft, tiny.tokenizer, "draft")
    return LoadedPair(target, draft, check_pair(target, draft), SpeculationKnobs())


@pytest.mark.parametrize("mode", ["single", "batch2"])
def test_a_variant_decodes_every_prompt_with_real_counts(mode: str) -> None:
    pair = tiny_pair()
    tok = pair.target.tokenizer
    prompts = [tok(t)["input_ids"] for t in ("Hello, how can", "My order has", "The refund")]
    reference = run_variant(pair, Variant("t", None), mode, prompts, COSTS, 12, False)
    assert reference.tokens == 36 and reference.draft_forwards == 0
    fixed = SpeculationKnobs(max_depth=3, min_depth=3, adaptive=False)
    run = run_variant(pair, Variant("k=3", fixed), mode, prompts, COSTS, 12, False)
    assert run.outputs == reference.outputs  # greedy: the same tokens
    assert 0 < run.accepted <= run.drafted
    assert run.target_forwards < reference.target_forwards
    charged = sum(
        count * COSTS[model](size)
        for model, sizes in run.forward_sizes.items()
        for size, count in sizes.items()
    )
    assert run.modelled_seconds == pytest.approx(charged)
    bad = run_variant(pair, Variant("k=3", fixed), mode, prompts, COSTS, 12, True)
    assert bad.outputs == reference.outputs and bad.accepted < run.accepted
    table = format_table([reference, run], {mode: reference})
    assert "k=3" in table and "1.00x" in table


def test_every_named_variant_is_built() -> None:
    known = variants()
    assert {"target-only", "default", "k=4"} <= set(known)
    assert known["target-only"].knobs is None
