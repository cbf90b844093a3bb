"""``stop_token_ids`` and ``ignore_eos`` on the tiny pair, speculative and target-only alike."""

from __future__ import annotations

import pytest
from tools.tiny_models import TinyPair, build_pair

from specpair_runtime.engine.api import SamplingParams
from specpair_runtime.engine.options import EngineOptions
from specpair_runtime.engine.speculative import SpeculativeEngine, generate
from tests.support.tiny_engines import tiny_engine

NEW = 24


@pytest.fixture(scope="module")
def pair() -> TinyPair:
    return build_pair("llama", seed=0)


@pytest.fixture(scope="module")
def prompt(pair: TinyPair) -> list[int]:
    ids: list[int] = pair.tokenizer("def add(a, b):")["input_ids"]
    return ids


def _engine(pair: TinyPair, depth: int | None) -> SpeculativeEngine:
    return tiny_engine(pair, depth, EngineOptions(max_slots=2, max_length=128))


def _free_output(pair: TinyPair, prompt: list[int]) -> list[int]:
    (free,) = generate(_engine(pair, None), [prompt], SamplingParams(max_new_tokens=NEW))
    assert len(free.token_ids) == NEW and len(set(free.token_ids)) > 3
    return free.token_ids


@pytest.mark.parametrize("depth", [None, 4, 8])
def test_a_stop_token_ends_the_output_there(
    pair: TinyPair, prompt: list[int], depth: int | None
) -> None:
    free = _free_output(pair, prompt)
    stop = free[NEW // 2]
    end = free.index(stop) + 1  # its first occurrence, kept like EOS
    params = SamplingParams(max_new_tokens=NEW, stop_token_ids=(stop,))
    (result,) = generate(_engine(pair, depth), [prompt], params)
    assert result.token_ids == free[:end]
    assert result.finish_reason == "stop"


@pytest.mark.parametrize("depth", [None, 4])
def test_ignore_eos_decodes_past_the_models_eos(
    pair: TinyPair, prompt: list[int], depth: int | None
) -> None:
    free = _free_output(pair, prompt)
    engine = _engine(pair, depth)
    engine.eos_ids = {free[3]}  # as if the model had ended there
    (ended,) = generate(engine, [prompt], SamplingParams(max_new_tokens=NEW))
    assert ended.token_ids == free[: free.index(free[3]) + 1]
    (ignored,) = generate(engine, [prompt], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    assert ignored.token_ids == free and ignored.finish_reason == "length"
    # A stop token still stops when EOS is ignored.
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True, stop_token_ids=(free[-2],))
    (stopped,) = generate(engine, [prompt], params)
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == free[-2]


def test_a_stop_token_outside_the_vocabulary_is_refused(pair: TinyPair, prompt: list[int]) -> None:
    engine = _engine(pair, 4)
    with pytest.raises(ValueError, match="stop_token_ids: token id"):
        engine.add_request("bad", prompt, SamplingParams(stop_token_ids=(engine.target.vocab,)))
