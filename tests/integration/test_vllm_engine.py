"""The real vLLM server (its CPU build) on a tiny pair: what engine vllm relies on.

Two servers per module, started once: vLLM with the draft in its
``--speculative-config`` (``draft_model``, the method the operator renders),
and vLLM with the target alone. On them:

- greedy speculative output equals vLLM's own target-only output, token by
  token, while the draft really drafts (its counters move);
- the gate sidecar (``specpair-runtime gate``, a real process) passes the
  golden prompts through vLLM's OpenAI API, and fails a wrong expectation
  and a draft with another tokenizer, naming what failed;
- the operator's acceptance parser reads vLLM's counters: drafts, draft
  tokens, accepted tokens, and accepted tokens per position.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from specpair_operator.acceptance import parse_metrics
from tests.support.gate_process import gate_config, run_gate
from tests.support.server_harness import free_port
from tests.support.vllm_server import (
    VllmServer,
    completion,
    draft_config,
    get_text,
    running,
    tiny_args,
)

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

NAME = "tiny"
PROMPTS = [
    "Hello, how can I help you today?",
    "My order has not arrived yet and",
    "def add(a, b):",
    "one two three four five",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from tools.tiny_models import save_vllm_pair

    return save_vllm_pair(tmp_path_factory.mktemp("vllm-pair"))


@pytest.fixture(scope="module")
def foreign_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The draft's architecture over another tokenizer: misaligned with the target."""
    from tools.tiny_models import VLLM_GEOMETRY, build_llama, build_tokenizer, save_model

    other = build_tokenizer(extra_corpus=("zebra quartz xylophone", "quixotic jazz vex"))
    root = tmp_path_factory.mktemp("foreign")
    return save_model(build_llama(other, seed=7, **VLLM_GEOMETRY), other, root / "draft")


@pytest.fixture(scope="module")
def speculative(
    pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    target, draft = pair
    log = tmp_path_factory.mktemp("vllm-logs") / "speculative.log"
    args = tiny_args(NAME) + draft_config(draft)
    with running(VllmServer(target, free_port(), log, args)) as server:
        yield server


@pytest.fixture(scope="module")
def target_only(
    pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    target, _ = pair
    log = tmp_path_factory.mktemp("vllm-logs") / "target-only.log"
    with running(VllmServer(target, free_port(), log, tiny_args(NAME))) as server:
        yield server


def test_greedy_speculative_output_equals_vllm_target_only(
    speculative: VllmServer, target_only: VllmServer
) -> None:
    before = parse_metrics(get_text(f"{speculative.url}/metrics"))
    for prompt in PROMPTS:
        spec = completion(speculative.url, NAME, prompt, MAX_TOKENS)
        plain = completion(target_only.url, NAME, prompt, MAX_TOKENS)
        assert spec["token_ids"] == plain["token_ids"], prompt
        assert spec["text"] == plain["text"]
        assert len(spec["token_ids"]) > 0
    after = parse_metrics(get_text(f"{speculative.url}/metrics"))
    # The draft really drafted: every prompt ran speculation steps.
    assert after.steps - before.steps >= len(PROMPTS)
    assert after.drafted - before.drafted == 4 * (after.steps - before.steps)
    assert 0 < after.accepted - before.accepted <= after.drafted - before.drafted
    # The target-only server never drafts.
    assert parse_metrics(get_text(f"{target_only.url}/metrics")).drafted == 0


def test_tensor_parallel_two_with_the_draft_sharded_alike_keeps_the_output(
    pair: tuple[Path, Path], target_only: VllmServer, tmp_path: Path
) -> None:
    """vLLM's CPU build splits the pair over two ranks (one core each), as on two GPUs."""
    target, draft = pair
    config = {
        "method": "draft_model",
        "model": str(draft),
        "num_speculative_tokens": 4,
        "draft_tensor_parallel_size": 2,
    }
    args = [*tiny_args(NAME), "--speculative-config", json.dumps(config)]
    args += ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]
    server = VllmServer(target, free_port(), tmp_path / "tp2.log", args)
    with running(server) as tp2:
        for prompt in PROMPTS:
            split = completion(tp2.url, NAME, prompt, MAX_TOKENS)
            assert (
                split["token_ids"]
                == completion(target_only.url, NAME, prompt, MAX_TOKENS)["token_ids"]
            ), prompt
        sample = parse_metrics(get_text(f"{tp2.url}/metrics"))
    assert sample.steps > 0 and 0 < sample.accepted <= sample.drafted
    assert "world_size=2" in server.tail(200_000)


def test_acceptance_parser_reads_vllm_counters(speculative: VllmServer) -> None:
    completion(speculative.url, NAME, PROMPTS[0], MAX_TOKENS)
    text = get_text(f"{speculative.url}/metrics")
    sample = parse_metrics(text)
    assert sample.steps > 0 and sample.drafted > 0
    assert sample.accepted <= sample.drafted
    # Per position: position 0 is accepted at least as often as any later one, and
    # the positions add up to the accepted tokens.
    positions = [sample.per_position[i] for i in sorted(sample.per_position)]
    assert len(positions) == 4
    assert positions == sorted(positions, reverse=True)
    assert sum(positions) == sample.accepted
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in text
    # Every accepted draft is a generated token; a step cut short by max_tokens
    # commits fewer than its accepted drafts plus one, so no tighter bound holds.
    assert 0 < sample.accepted < sample.generated


# --- the gate sidecar -------------------------------------------------------------------


def test_gate_passes_the_golden_prompts_through_vllm(
    speculative: VllmServer, pair: tuple[Path, Path], tmp_path: Path
) -> None:
    target, draft = pair
    expected = completion(speculative.url, NAME, PROMPTS[0], 8)["text"]
    prompts = [
        {
            "name": "greeting",
            "prompt": PROMPTS[0],
            "maxNewTokens": 8,
            "expect": {"equals": expected},
        },
        {"name": "chat", "prompt": "Where is my parcel?", "chat": True, "maxNewTokens": 12},
    ]
    config, port = gate_config(tmp_path, speculative, target, draft, prompts)
    body = run_gate(config, port, tmp_path / "gate.log")
    assert body == {
        "ready": True,
        "phase": "ready",
        "reason": "alignment and golden prompts passed",
    }


def test_gate_fails_a_wrong_expectation_and_names_it(
    speculative: VllmServer, pair: tuple[Path, Path], tmp_path: Path
) -> None:
    target, draft = pair
    prompts = [
        {"name": "ok", "prompt": PROMPTS[1], "maxNewTokens": 8},
        {
            "name": "capital",
            "prompt": PROMPTS[2],
            "maxNewTokens": 8,
            "expect": {"contains": ["Paris"]},
        },
    ]
    config, port = gate_config(tmp_path, speculative, target, draft, prompts)
    body = run_gate(config, port, tmp_path / "gate.log")
    assert body["ready"] is False and body["phase"] == "failed"
    assert body["reason"].startswith(
        "golden prompts failed: capital: output does not contain 'Paris'"
    )
    assert "ok:" not in body["reason"]


def test_gate_refuses_a_draft_with_another_tokenizer(
    speculative: VllmServer, pair: tuple[Path, Path], foreign_draft: Path, tmp_path: Path
) -> None:
    target, _ = pair
    config, port = gate_config(tmp_path, speculative, target, foreign_draft, None)
    body = run_gate(config, port, tmp_path / "gate.log")
    assert body["phase"] == "failed"
    assert body["reason"].startswith("draft is not aligned with the target: vocab:")
