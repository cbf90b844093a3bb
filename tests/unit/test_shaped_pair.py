"""The shaped pair has the real pair's architecture, so its forward costs stand for the pair's."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch
from tools.shaped_pair import REAL_PAIR_SHAPES, QwenShape, shaped_config, write_shaped_pair
from tools.tiny_models import build_tokenizer
from transformers import AutoConfig

from specpair_runtime.config import ModelSpec, SpeculationKnobs
from specpair_runtime.engine.pair import load_pair
from tests.support.real_models import require_real_pair


@pytest.mark.slow
def test_the_shapes_are_those_of_the_cached_real_pair() -> None:
    real = require_real_pair()
    for role, directory in (("target", real.target_dir), ("draft", real.draft_dir)):
        config = json.loads((directory / "config.json").read_text())
        shape = REAL_PAIR_SHAPES[role]  # type: ignore[index]
        for field in fields(QwenShape):
            assert config[field.name] == getattr(shape, field.name), (role, field.name)


def test_a_written_pair_loads_as_an_aligned_pair_of_the_given_shapes(tmp_path: Path) -> None:
    # The real shapes, scaled down in depth and width so the test stays small.
    small = {
        role: replace(
            shape,
            num_hidden_layers=1,
            hidden_size=shape.hidden_size // 4,
            intermediate_size=256,
            vocab_size=4096,
        )
        for role, shape in REAL_PAIR_SHAPES.items()
    }
    dirs = write_shaped_pair(tmp_path, dtype=torch.float32, shapes=small)
    pair = load_pair(
        ModelSpec(source=str(dirs["target"])),
        ModelSpec(source=str(dirs["draft"])),
        SpeculationKnobs(),
        "cpu",
    )
    assert pair.alignment is not None and pair.alignment.aligned, pair.alignment
    for role, loaded in (("target", pair.target), ("draft", pair.draft)):
        assert loaded is not None
        config = AutoConfig.from_pretrained(dirs[role])  # type: ignore[index]
        assert config.hidden_size == small[role].hidden_size  # type: ignore[index]
        assert config.vocab_size == 4096


def test_the_config_keeps_the_shape() -> None:
    config = shaped_config(REAL_PAIR_SHAPES["target"], torch.bfloat16, build_tokenizer())
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (
        1536,
        28,
        2,
    )
