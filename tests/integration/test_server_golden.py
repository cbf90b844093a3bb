"""Readiness gates: golden prompts and alignment block /readyz, and say why."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support.server_harness import (
    in_process_server,
    target_only,
    wait_until_ready,
    write_config,
)

pytestmark = pytest.mark.integration

PROMPTS = ["Hello, how can I help", "The refund will"]


def golden_file(path: Path, prompts: list[dict[str, object]]) -> Path:
    path.write_text(yaml.safe_dump({"prompts": prompts}))
    return path


def test_passing_golden_prompts_make_it_ready(pair: tuple[Path, Path], tmp_path: Path) -> None:
    expected = target_only(*pair, PROMPTS, 12)
    checked = [
        {"name": f"p{i}", "prompt": p, "maxNewTokens": 12, "expect": {"equals": text}}
        for i, (p, text) in enumerate(zip(PROMPTS, expected, strict=True))
    ]
    # Enough decoding that the golden phase lasts long enough to be observed.
    filler = [{"name": f"f{i}", "prompt": f"{i} one two", "maxNewTokens": 64} for i in range(6)]
    golden = golden_file(tmp_path / "golden.yaml", checked + filler)
    config = write_config(
        tmp_path / "config.yaml", *pair, serving={"goldenPromptsFile": str(golden)}
    )
    with in_process_server(config, wait_ready=False) as server:
        phases: list[str] = []
        refused_checked = False
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            response = httpx.get(f"{server.base_url}/readyz")
            body = response.json()
            if not phases or phases[-1] != body["phase"]:
                phases.append(body["phase"])
            if body["phase"] in ("ready", "failed"):
                break
            assert response.status_code == 503 and body["ready"] is False
            # While unready the API refuses work, naming the phase. Asked once, on
            # entering the phase: asked on every poll, the last ask races the
            # switch to ready that happens between the GET and the POST.
            if body["phase"] == "golden_prompts" and not refused_checked:
                refused_checked = True
                refused = httpx.post(
                    f"{server.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}
                )
                assert refused.status_code == 503
            time.sleep(0.01)
        assert body == {"ready": True, "phase": "ready", "reason": "serving"}
        assert "golden_prompts" in phases and phases.index("golden_prompts") < phases.index("ready")
        response = httpx.post(
            f"{server.base_url}/v1/completions",
            json={"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0},
        )
        assert response.json()["choices"][0]["text"] == expected[0]


def test_failing_golden_prompt_keeps_it_unready_with_the_reason(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    golden = golden_file(
        tmp_path / "golden.yaml",
        [
            {"name": "fine", "prompt": PROMPTS[0], "maxNewTokens": 8},
            {
                "name": "greeting",
                "prompt": PROMPTS[1],
                "maxNewTokens": 8,
                "expect": {"contains": ["never-in-a-tiny-model-output"]},
            },
        ],
    )
    config = write_config(
        tmp_path / "config.yaml", *pair, serving={"goldenPromptsFile": str(golden)}
    )
    with in_process_server(config, wait_ready=False) as server:
        body = wait_until_ready(server.base_url)
        assert body["ready"] is False and body["phase"] == "failed"
        assert "golden prompts failed" in body["reason"]
        assert "greeting" in body["reason"] and "never-in-a-tiny-model-output" in body["reason"]
        assert "fine" not in body["reason"].split("failed:", 1)[1]
        assert httpx.get(f"{server.base_url}/readyz").status_code == 503
        response = httpx.post(
            f"{server.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}
        )
        assert response.status_code == 503
        assert "golden" in response.json()["error"]["message"]
        assert httpx.get(f"{server.base_url}/healthz").status_code == 200


def test_invalid_golden_file_is_reported(pair: tuple[Path, Path], tmp_path: Path) -> None:
    golden = tmp_path / "golden.yaml"
    golden.write_text(
        yaml.safe_dump({"prompts": [{"name": "x", "promt": "typo"}], "nearTieMargin": -1})
    )
    config = write_config(
        tmp_path / "config.yaml", *pair, serving={"goldenPromptsFile": str(golden)}
    )
    with in_process_server(config, wait_ready=False) as server:
        body = wait_until_ready(server.base_url)
        assert body["phase"] == "failed"
        assert "golden prompts file invalid" in body["reason"] and "promt" in body["reason"]
        assert "nearTieMargin: Input should be greater than or equal to 0" in body["reason"]


def test_misaligned_draft_keeps_it_unready(tmp_path: Path) -> None:
    from tools.tiny_models import build_llama, build_tokenizer, save_model

    target_tok = build_tokenizer()
    draft_tok = build_tokenizer(extra_corpus=("zebra xylophone quartz " * 8,))
    target = save_model(build_llama(target_tok, 0), target_tok, tmp_path / "target")
    draft = save_model(build_llama(draft_tok, 1), draft_tok, tmp_path / "draft")
    config = write_config(tmp_path / "config.yaml", target, draft)
    with in_process_server(config, wait_ready=False) as server:
        body = wait_until_ready(server.base_url)
        assert body["phase"] == "failed"
        assert "not aligned" in body["reason"] and "vocab" in body["reason"]
