"""Loading models from HF directories, GGUF files and pvc:// paths, offline."""

from __future__ import annotations

import io
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from tools import fetch_models as fm
from tools.tiny_models import build_llama, build_pair, build_tokenizer, save_model, save_pair
from transformers import AutoModelForCausalLM

from specpair_runtime.config import ModelSpec, Quantization, SpeculationKnobs
from specpair_runtime.engine.api import SamplingParams
from specpair_runtime.engine.cpu.int4 import Int4Linear, can_quantize
from specpair_runtime.engine.fused_projections import fuse_projections
from specpair_runtime.engine.loading import (
    LoadError,
    load_model,
    parse_hf_source,
    pvc_path,
    resolve_device,
    resolve_dtype,
)
from specpair_runtime.engine.oneshot import run_request
from specpair_runtime.engine.pair import check_pair, load_pair
from specpair_runtime.engine.speculative import eos_token_ids
from tests.support.tiny_gguf import write_llama_gguf

PROMPT = "Hello, how can I help you today?"


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_pair(tmp_path_factory.mktemp("pair"))


def logits(model: Any, tokenizer: Any, text: str = PROMPT) -> torch.Tensor:
    ids = torch.tensor([tokenizer(text).input_ids])
    with torch.no_grad():
        result: torch.Tensor = model(ids).logits
    return result


def test_loads_hf_directory_unchanged(pair_dirs: tuple[Path, Path]) -> None:
    target_dir, _ = pair_dirs
    loaded = load_model(ModelSpec(source=str(target_dir)), "target", "cpu")
    assert loaded.device == torch.device("cpu")
    assert loaded.dtype == torch.float32
    assert loaded.name == "target"
    assert loaded.source == str(target_dir)
    assert not loaded.model.training
    assert next(loaded.model.parameters()).dtype == torch.float32
    reference = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    torch.testing.assert_close(
        logits(loaded.model, loaded.tokenizer), logits(reference, loaded.tokenizer)
    )


def test_explicit_dtype_is_applied(pair_dirs: tuple[Path, Path]) -> None:
    loaded = load_model(ModelSpec(source=str(pair_dirs[1]), dtype="bfloat16"), "draft", "cpu")
    assert loaded.dtype == torch.bfloat16
    assert next(loaded.model.parameters()).dtype == torch.bfloat16


def test_auto_dtype_and_default_device() -> None:
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device(None).type == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
def test_cuda_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(LoadError, match="CUDA is not available"):
        resolve_device("cuda")


@pytest.mark.cuda
def test_auto_dtype_on_cuda_is_half_precision(pair_dirs: tuple[Path, Path]) -> None:
    loaded = load_model(ModelSpec(source=str(pair_dirs[0])), "target", "cuda")
    assert loaded.device.type == "cuda"
    assert loaded.dtype in (torch.bfloat16, torch.float16)
    assert next(loaded.model.parameters()).device.type == "cuda"


def test_missing_directory_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(LoadError) as info:
        load_model(ModelSpec(source=str(missing)), "target")
    assert str(info.value) == f"{missing}: no such file or directory ({missing})"


def test_directory_without_config_is_named(tmp_path: Path) -> None:
    with pytest.raises(LoadError, match=r"no config\.json in .* \(not a Hugging Face model"):
        load_model(ModelSpec(source=str(tmp_path)), "target")


def test_file_that_is_not_gguf_is_named(tmp_path: Path) -> None:
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"x")
    with pytest.raises(LoadError, match=re.escape("a file source must be a .gguf file")):
        load_model(ModelSpec(source=str(weights)), "target")


def test_broken_config_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(LoadError) as info:
        load_model(ModelSpec(source=str(tmp_path)), "target")
    assert "\n" not in str(info.value)
    assert str(info.value).startswith(f"{tmp_path}: cannot load the ")


def test_hf_source_offline_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(LoadError) as info:
        load_model(ModelSpec(source="hf://specpair-test/no-such-model@main"), "draft")
    message = str(info.value)
    assert message.startswith("hf://specpair-test/no-such-model@main: cannot download")
    assert "HF_HUB_OFFLINE" in message
    assert "\n" not in message


def test_hf_source_parsing() -> None:
    assert parse_hf_source("hf://org/name@v1", None) == ("org/name", "v1")
    assert parse_hf_source("hf://org/name", "abc") == ("org/name", "abc")
    with pytest.raises(LoadError, match="contradicts"):
        parse_hf_source("hf://org/name@v1", "v2")
    with pytest.raises(LoadError, match=r"expected hf://<org>/<name>"):
        parse_hf_source("hf://just-a-name", None)


def test_unknown_scheme_and_local_revision_are_named(pair_dirs: tuple[Path, Path]) -> None:
    with pytest.raises(LoadError, match="unknown scheme"):
        load_model(ModelSpec(source="s3://bucket/model"), "target")
    with pytest.raises(LoadError, match="revision is only supported for hf://"):
        load_model(ModelSpec(source=str(pair_dirs[0]), revision="v1"), "target")


def test_pvc_source_maps_to_the_mount_root(
    pair_dirs: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mounted = tmp_path / "claim-a" / "models"
    mounted.mkdir(parents=True)
    (mounted / "target").symlink_to(pair_dirs[0])
    monkeypatch.setenv("SPECPAIR_PVC_ROOT", str(tmp_path))
    loaded = load_model(ModelSpec(source="pvc://claim-a/models/target"), "target", "cpu")
    assert loaded.name == "target"
    assert pvc_path("pvc://c/x/y", "/models") == Path("/models/c/x/y")
    with pytest.raises(LoadError, match=re.escape("'..' is not allowed")):
        pvc_path("pvc://c/../etc", "/models")


def test_target_quantization_is_refused(pair_dirs: tuple[Path, Path]) -> None:
    spec = ModelSpec(source=str(pair_dirs[0]), quantization="int8-dynamic")
    with pytest.raises(LoadError, match=re.escape("target.quantization must be 'none'")):
        load_model(spec, "target", "cpu")


@pytest.mark.parametrize("quantization", ["int8-dynamic", "int4-weight"])
def test_quantized_draft_keeps_greedy_output(
    pair_dirs: tuple[Path, Path], quantization: Quantization
) -> None:
    target_dir, draft_dir = pair_dirs
    draft_spec = ModelSpec(source=str(draft_dir), quantization=quantization)
    pair = load_pair(
        ModelSpec(source=str(target_dir)),
        draft_spec,
        SpeculationKnobs(max_depth=3, adaptive=False, min_depth=3),
        "cpu",
    )
    assert pair.draft is not None and pair.draft.quantization == quantization
    quantized_type = (
        torch.ao.nn.quantized.dynamic.Linear if quantization == "int8-dynamic" else Int4Linear
    )
    quantized = [m for m in pair.draft.model.modules() if isinstance(m, quantized_type)]
    plain = AutoModelForCausalLM.from_pretrained(draft_dir)
    fuse_projections(plain)  # as the loader does, before it quantizes
    packable = [
        m
        for m in plain.modules()
        if isinstance(m, torch.nn.Linear)
        and (quantization == "int8-dynamic" or can_quantize(m.weight))
    ]
    assert len(quantized) == len(packable) > 0
    left = [m for m in pair.draft.model.modules() if type(m) is torch.nn.Linear]
    assert len(left) == sum(isinstance(m, torch.nn.Linear) for m in plain.modules()) - len(packable)
    # The target itself is never touched.
    assert any(isinstance(m, torch.nn.Linear) for m in pair.target.model.modules())

    prompt = pair.target.tokenizer(PROMPT).input_ids
    params = SamplingParams(max_new_tokens=24)
    speculative = run_request(pair.engine(), prompt, params)
    baseline = run_request(pair.engine(speculate=False), prompt, params)
    assert speculative.stats.drafted_tokens > 0
    assert speculative.stats.accepted_tokens > 0
    assert speculative.token_ids == baseline.token_ids


def test_quantization_needs_the_cpu_and_float32(pair_dirs: tuple[Path, Path]) -> None:
    spec = ModelSpec(source=str(pair_dirs[1]), quantization="int4-weight", dtype="bfloat16")
    expected = "draft.quantization int4-weight needs dtype float32, got torch.bfloat16"
    with pytest.raises(LoadError, match=re.escape(expected)):
        load_model(spec, "draft", "cpu")


def test_gguf_file_loads_the_same_model(tmp_path: Path) -> None:
    tiny = build_pair("llama", seed=3)
    gguf_path = write_llama_gguf(tiny.target, tiny.tokenizer, tmp_path / "tiny-target.gguf")
    expected = logits(tiny.target, tiny.tokenizer)

    by_file = load_model(ModelSpec(source=str(gguf_path)), "target", "cpu")
    by_dir = load_model(ModelSpec(source=str(tmp_path)), "target", "cpu")  # the one .gguf in it
    named = load_model(
        ModelSpec(source=str(tmp_path), gguf_file="tiny-target.gguf"), "target", "cpu"
    )
    for loaded in (by_file, by_dir, named):
        assert loaded.name == "tiny-target.gguf"
        assert loaded.tokenizer(PROMPT).input_ids == tiny.tokenizer(PROMPT).input_ids
        torch.testing.assert_close(logits(loaded.model, loaded.tokenizer), expected)

    # A GGUF target with an HF-directory draft over the same tokenizer is aligned.
    draft = load_model(
        ModelSpec(source=str(save_model(tiny.draft, tiny.tokenizer, tmp_path / "draft"))),
        "draft",
        "cpu",
    )
    report = check_pair(by_file, draft)
    assert report.aligned, report.problems


def test_a_gguf_model_ends_on_every_end_of_generation_token(tmp_path: Path) -> None:
    """A GGUF file names one EOS (Qwen's: ``<|im_end|>``). Loaded from the file, or
    converted by ``make models``, the model also ends on the special tokens that
    llama.cpp ends on (Qwen's ``<|endoftext|>``); an HF directory keeps its own."""
    tokenizer = build_tokenizer(bos="<|endoftext|>", eos="<|im_end|>")
    model = build_llama(tokenizer, seed=5)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ends = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>", "<|end|>")}
    layout = fm.CacheLayout(tmp_path / "cache")
    src = replace(fm.SOURCES["target"], name="tiny-qwen-like")
    layout.gguf_dir.mkdir(parents=True)
    gguf_path = write_llama_gguf(model, tokenizer, layout.gguf_path(src))

    from_file = load_model(ModelSpec(source=str(gguf_path)), "target", "cpu")
    assert eos_token_ids(from_file) == ends

    marker = fm.convert_worker(src, layout, fm.Reporter(io.StringIO()))
    assert marker["eos_token_ids"][0] == im_end  # the GGUF's own EOS stays first
    assert set(marker["eos_token_ids"]) == ends
    converted = load_model(ModelSpec(source=str(layout.model_dir(src))), "target", "cpu")
    assert eos_token_ids(converted) == ends

    hf_dir = save_model(model, tokenizer, tmp_path / "hf")
    assert eos_token_ids(load_model(ModelSpec(source=str(hf_dir)), "target", "cpu")) == {im_end}


def test_gguf_file_name_errors(tmp_path: Path) -> None:
    with pytest.raises(LoadError, match=re.escape("gguf_file 'x.gguf' not found")):
        load_model(ModelSpec(source=str(tmp_path), gguf_file="x.gguf"), "target")
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(LoadError, match=re.escape("several .gguf files")):
        load_model(ModelSpec(source=str(tmp_path)), "target")
