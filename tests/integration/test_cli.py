"""The ``specpair-runtime`` CLI contract, run as real subprocesses on tiny models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from tools.tiny_models import build_pair, build_tokenizer, save_model, save_pair
from transformers import AutoModelForCausalLM, AutoTokenizer

from specpair_runtime.engine.prompting import encode_prompt

PROMPT = "My order has not arrived yet"
MAX_NEW = 12
STATS_KEYS = {
    "drafted_tokens": int,
    "accepted_tokens": int,
    "acceptance_rate": float,
    "mean_accepted_length": float,
    "target_passes": int,
    "tokens_per_second": float,
}


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.run(
        [sys.executable, "-m", "specpair_runtime", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_pair(tmp_path_factory.mktemp("cli-pair"))


@pytest.fixture(scope="module")
def misaligned_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A draft over a tokenizer trained on more text: its merges, so its ids, differ."""
    tokenizer = build_tokenizer(extra_corpus=("zebra quantum xylophone jukebox",) * 3)
    draft = build_pair("llama", seed=5, tokenizer=tokenizer).draft
    return save_model(draft, tokenizer, tmp_path_factory.mktemp("misaligned") / "draft")


def hf_greedy(target_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Target-only greedy decoding by transformers itself: the independent reference."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    return [int(i) for i in out[0, len(prompt_ids) :]]


def without_eos(ids: list[int], eos: int) -> list[int]:
    return ids[: ids.index(eos)] if eos in ids else ids


def parse_one_json(stdout: str) -> dict[str, Any]:
    """stdout must hold exactly one JSON object and nothing else."""
    decoded: dict[str, Any] = json.loads(stdout)
    assert stdout.strip().count("\n") == 0
    return decoded


def assert_generate_schema(result: dict[str, Any]) -> None:
    assert set(result) == {"text", "token_ids", "stats"}
    assert isinstance(result["text"], str)
    assert all(isinstance(i, int) for i in result["token_ids"])
    assert set(result["stats"]) == set(STATS_KEYS)
    for key, kind in STATS_KEYS.items():
        assert isinstance(result["stats"][key], kind), key


def test_generate_json_matches_target_only_greedy(pair_dirs: tuple[Path, Path]) -> None:
    target_dir, draft_dir = pair_dirs
    run = cli(
        "generate", "--target", str(target_dir), "--draft", str(draft_dir),
        "--prompt", PROMPT, "--max-new-tokens", str(MAX_NEW), "--depth", "3", "--json",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    result = parse_one_json(run.stdout)
    assert_generate_schema(result)
    stats = result["stats"]
    assert stats["drafted_tokens"] > 0
    assert 0 <= stats["accepted_tokens"] <= stats["drafted_tokens"]
    assert stats["acceptance_rate"] == pytest.approx(
        stats["accepted_tokens"] / stats["drafted_tokens"]
    )
    assert stats["target_passes"] < len(result["token_ids"]) + 2

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompt_ids = encode_prompt(tokenizer, PROMPT)
    expected = hf_greedy(target_dir, prompt_ids, MAX_NEW)
    eos = int(tokenizer.eos_token_id)
    assert without_eos(result["token_ids"], eos) == without_eos(expected, eos)
    assert result["text"] == tokenizer.decode(
        without_eos(result["token_ids"], eos), skip_special_tokens=True
    )

    plain = cli(
        "generate", "--target", str(target_dir), "--no-speculation",
        "--prompt", PROMPT, "--max-new-tokens", str(MAX_NEW), "--json",
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    target_only = parse_one_json(plain.stdout)
    assert_generate_schema(target_only)
    assert target_only["token_ids"] == result["token_ids"]
    assert target_only["stats"]["drafted_tokens"] == 0


def test_generate_chat_applies_the_template(pair_dirs: tuple[Path, Path]) -> None:
    target_dir, draft_dir = pair_dirs
    run = cli(
        "generate", "--target", str(target_dir), "--draft", str(draft_dir), "--chat",
        "--prompt", PROMPT, "--max-new-tokens", str(MAX_NEW), "--json",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    result = parse_one_json(run.stdout)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    chat_ids = encode_prompt(tokenizer, PROMPT, chat=True)
    assert chat_ids != encode_prompt(tokenizer, PROMPT)
    eos = int(tokenizer.eos_token_id)
    expected = hf_greedy(target_dir, chat_ids, MAX_NEW)
    assert without_eos(result["token_ids"], eos) == without_eos(expected, eos)


def test_generate_streams_text_to_stdout_and_stats_to_stderr(
    pair_dirs: tuple[Path, Path],
) -> None:
    target_dir, draft_dir = pair_dirs
    run = cli(
        "generate", "--target", str(target_dir), "--draft", str(draft_dir),
        "--prompt", PROMPT, "--max-new-tokens", "6",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "tokens/s" not in run.stdout
    assert "tokens/s" in run.stderr
    assert "acceptance" in run.stderr


def write_golden(path: Path, expect: dict[str, Any]) -> Path:
    document = {
        "prompts": [{"name": "order", "prompt": PROMPT, "maxNewTokens": 8, "expect": expect}]
    }
    path.write_text(yaml.safe_dump(document))
    return path


def test_check_exit_codes(
    pair_dirs: tuple[Path, Path], misaligned_draft: Path, tmp_path: Path
) -> None:
    target_dir, draft_dir = pair_dirs
    models = ("--target", str(target_dir), "--draft", str(draft_dir))

    # What the pair really says for the golden prompt, so the passing file is honest.
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    expected_ids = hf_greedy(target_dir, encode_prompt(tokenizer, PROMPT), 8)
    eos = int(tokenizer.eos_token_id)
    text = str(tokenizer.decode(without_eos(expected_ids, eos), skip_special_tokens=True))
    assert text.strip(), "the tiny target produced no text; pick another prompt"

    passing = write_golden(tmp_path / "pass.yaml", {"contains": [text[:4]], "equals": text})
    run = cli("check", *models, "--golden", str(passing), "--json")
    assert run.returncode == 0, run.stdout + run.stderr
    report = parse_one_json(run.stdout)
    assert report["aligned"] is True and report["problems"] == []
    assert report["passed"] is True
    [prompt] = report["prompts"]
    assert prompt["name"] == "order" and prompt["passed"] is True
    assert prompt["token_ids"] == prompt["baseline_token_ids"]
    assert prompt["text"] == text

    failing = write_golden(tmp_path / "fail.yaml", {"contains": ["refund-zzz"]})
    run = cli("check", *models, "--golden", str(failing), "--json")
    assert run.returncode == 1, run.stdout + run.stderr
    report = parse_one_json(run.stdout)
    assert report["aligned"] is True and report["passed"] is False
    assert report["prompts"][0]["failures"] == ["output does not contain 'refund-zzz'"]

    human = cli("check", *models, "--golden", str(failing))
    assert human.returncode == 1
    assert "FAIL" in human.stdout and "refund-zzz" in human.stdout

    misaligned = cli(
        "check", "--target", str(target_dir), "--draft", str(misaligned_draft), "--json"
    )
    assert misaligned.returncode == 1, misaligned.stderr
    report = parse_one_json(misaligned.stdout)
    assert report["aligned"] is False
    assert any(problem.startswith("vocab: ") for problem in report["problems"])


def test_generate_on_misaligned_pair_falls_back_to_target_only(
    pair_dirs: tuple[Path, Path], misaligned_draft: Path
) -> None:
    target_dir, _ = pair_dirs
    run = cli(
        "generate", "--target", str(target_dir), "--draft", str(misaligned_draft),
        "--prompt", PROMPT, "--max-new-tokens", "6", "--json",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    result = parse_one_json(run.stdout)
    assert result["stats"]["drafted_tokens"] == 0
    assert "speculation refused" in run.stderr and "vocab" in run.stderr


def test_bench_compares_modes_and_plots(pair_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    target_dir, draft_dir = pair_dirs
    plot = tmp_path / "bench.png"
    run = cli(
        "bench", "--target", str(target_dir), "--draft", str(draft_dir), "--no-chat",
        "--prompt", PROMPT, "--prompt", "Can I change the delivery address?",
        "--max-new-tokens", "6", "--depths", "1,2", "--runs", "2", "--plot", str(plot), "--json",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = parse_one_json(run.stdout)
    modes = {row["mode"]: row for row in report["modes"]}
    assert list(modes) == [
        "target-only",
        "specpair k=1",
        "specpair k=2",
        "specpair default (adaptive<=4)",
        "specpair default (adaptive<=4), no prefix reuse",
        "target-only, json schema",
        "specpair default (adaptive<=4), json schema",
        "hf-assisted",
        "hf-assisted (onednn)",
    ]
    # Under the grammar: identical to target-only under the same grammar, with a mask cost.
    structured = modes["specpair default (adaptive<=4), json schema"]
    assert structured["mask_ms_per_target_pass"] > 0 and structured["mask_us_per_position"] > 0
    assert modes["target-only, json schema"]["vs_target_only"] == pytest.approx(1.0)
    assert modes["target-only"]["mask_ms_per_target_pass"] is None
    for row in modes.values():
        assert row["identical_to_target_only"] is True, row["mode"]
        assert row["tokens"] > 0 and row["tokens_per_second"] > 0
        assert len(row["tokens_per_second_per_round"]) == 2  # one rate per round
        assert len(row["vs_target_only_per_round"]) == 2
    assert modes["target-only"]["vs_target_only"] == pytest.approx(1.0)
    assert modes["specpair k=2"]["drafted_tokens"] > 0
    assert modes["hf-assisted"]["acceptance_rate"] is None
    assert "stock transformers" in str(report["machine"]["hf_assisted_kernels"])
    assert report["best_fixed_depth"] in ("specpair k=1", "specpair k=2")
    best = modes[report["best_fixed_depth"]]
    assert best["vs_best_fixed_depth_per_round"] == pytest.approx([1.0, 1.0])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--depth", "0"], "argument --depth: must be a positive integer, got 0"),
        (["--depth", "17"], "argument --depth: must be at most 16, got 17"),
        (["--temperature", "-0.5"], "argument --temperature: must be >= 0"),
        (["--top-p", "1.5"], "argument --top-p: must be in (0, 1], got 1.5"),
        (["--top-p", "0"], "argument --top-p: must be in (0, 1], got 0.0"),
        (["--top-k", "-1"], "argument --top-k: must be a non-negative integer, got -1"),
        (["--draft-confidence", "1.5"], "argument --draft-confidence: must be in [0, 1], got 1.5"),
        (["--max-new-tokens", "ten"], "argument --max-new-tokens: must be a positive integer"),
        (["--dtype", "int4"], "argument --dtype: invalid choice: 'int4'"),
    ],
)
def test_bad_generate_arguments_exit_2_with_one_line(
    pair_dirs: tuple[Path, Path], args: list[str], needle: str
) -> None:
    target_dir, draft_dir = pair_dirs
    run = cli(
        "generate", "--target", str(target_dir), "--draft", str(draft_dir), "--prompt", "x", *args
    )
    assert run.returncode == 2
    assert run.stdout == ""
    assert run.stderr.count("\n") == 1, run.stderr
    assert needle in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["generate", "--target", "/no/such/model", "--draft", "/tmp", "--prompt", "x"],
         "argument --target: no such directory or .gguf file: /no/such/model"),
        (["check", "--target", "/tmp", "--draft", "s3://bucket/m"],
         "argument --draft: unknown scheme in 's3://bucket/m'"),
        (["check", "--target", "/tmp", "--draft", "/tmp", "--golden", "/no/golden.yaml"],
         "argument --golden: no such file: /no/golden.yaml"),
        (["bench", "--target", "/tmp", "--draft", "/tmp", "--depths", "1,0"],
         "argument --depths: must be a positive integer, got 0"),
        (["bench", "--target", "/tmp", "--draft", "/tmp", "--plot", "out.jpg"],
         "argument --plot: must be a .png file name"),
        (["generate", "--target", "/tmp", "--prompt", "x"],
         "argument --draft: required unless --no-speculation is given"),
        (["generate", "--draft", "/tmp", "--prompt", "x"],
         "the following arguments are required: --target"),
        (["frobnicate"], "argument COMMAND: invalid choice: 'frobnicate'"),
        (["check", "--target", "/tmp", "--draft", "/tmp", "--device", "gpu0"],
         "device 'gpu0' is not a valid torch device"),
    ],
)  # fmt: skip
def test_bad_arguments_exit_2_with_one_line(args: list[str], needle: str) -> None:
    run = cli(*args)
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1, run.stderr
    assert needle in run.stderr
    assert "Traceback" not in run.stderr


def test_model_directory_without_config_exits_2(
    tmp_path: Path, pair_dirs: tuple[Path, Path]
) -> None:
    run = cli("check", "--target", str(tmp_path), "--draft", str(pair_dirs[1]))
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        f"specpair-runtime check: error: {tmp_path}: no config.json in {tmp_path} "
        "(not a Hugging Face model directory)"
    ]


def test_bad_golden_file_exits_2(tmp_path: Path, pair_dirs: tuple[Path, Path]) -> None:
    golden = tmp_path / "golden.yaml"
    golden.write_text(
        yaml.safe_dump({"prompts": [{"name": "x", "prompt": "y", "maxNewTokens": 0}]})
    )
    run = cli(
        "check",
        "--target",
        str(pair_dirs[0]),
        "--draft",
        str(pair_dirs[1]),
        "--golden",
        str(golden),
    )
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1, run.stderr
    assert "prompts.0.maxNewTokens" in run.stderr
    assert "Traceback" not in run.stderr


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).with_name("specpair-runtime")
    if not script.exists():
        pytest.skip(f"{script} not installed (pip install -e . creates it)")
    run = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=False)
    assert run.returncode == 0
    for command in ("generate", "check", "bench"):
        assert command in run.stdout
