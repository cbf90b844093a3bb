"""Load one model of the pair (weights + tokenizer) from a local source.

Sources: a directory in Hugging Face layout, a ``.gguf`` file (or a directory
plus ``gguf_file``), ``pvc://claim/path`` (a mounted volume) and
``hf://org/name[@rev]`` (downloaded with ``huggingface_hub``; the tests never
take that path, they run offline). Local sources are always loaded with
``local_files_only`` so that loading never touches a network. A model read
from GGUF also ends on the special tokens that llama.cpp ends on
(``end_of_generation.py``): the file names only one EOS.

The loader also makes the one-time rewrites that the engine runs on
(``prepare_model``): fused projections on every device, and on the CPU the
draft's quantization and the prepacked oneDNN linears (``engine/cpu/``,
imported only there). Engines built over the loaded models share them as
they are, so a benchmark or a golden check can build several.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from specpair_runtime.config import Dtype, ModelSpec, Quantization
from specpair_runtime.engine.end_of_generation import add_end_of_generation
from specpair_runtime.engine.fused_projections import fuse_projections

log = logging.getLogger(__name__)

Role = Literal["target", "draft"]
# The CPU's linears: prepacked oneDNN (the engine's), or PyTorch's default (as on CUDA).
CpuKernels = Literal["onednn", "default"]

PVC_ROOT_ENV = "SPECPAIR_PVC_ROOT"
DEFAULT_PVC_ROOT = "/models"
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class LoadError(ValueError):
    """A model that cannot be loaded; the message is one line naming the source."""


@dataclass
class LoadedModel:
    """A causal LM ready for decoding, with its tokenizer and placement."""

    model: Any  # transformers PreTrainedModel (untyped library)
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    name: str
    source: str
    quantization: Quantization = "none"


@dataclass(frozen=True)
class ResolvedSource:
    """A source mapped to local files: a model directory and an optional GGUF file in it."""

    directory: Path
    gguf_file: str | None


def resolve_device(device: str | None) -> torch.device:
    """The requested device, else CUDA when present, else the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise LoadError(f"device {device!r} is not a valid torch device") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise LoadError(f"device {device!r} requested but CUDA is not available")
    return resolved


def resolve_dtype(dtype: Dtype, device: torch.device) -> torch.dtype:
    """``auto``: float32 on the CPU (bf16 is slower there), bfloat16 on CUDA (fp16 if no bf16)."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def pvc_path(source: str, root: str | None = None) -> Path:
    """Map ``pvc://claim/path`` to ``<root>/claim/path``; root: $SPECPAIR_PVC_ROOT or /models."""
    rest = source.removeprefix("pvc://").strip("/")
    if not rest or rest.startswith("."):
        raise LoadError(f"{source}: expected pvc://<claim>/<path>")
    parts = Path(rest).parts
    if ".." in parts:
        raise LoadError(f"{source}: '..' is not allowed in a pvc:// path")
    base = root if root is not None else os.environ.get(PVC_ROOT_ENV, DEFAULT_PVC_ROOT)
    return Path(base, *parts)


def parse_hf_source(source: str, revision: str | None) -> tuple[str, str | None]:
    """``hf://org/name[@rev]`` -> (repo id, revision); an explicit ``revision`` must agree."""
    rest = source.removeprefix("hf://").strip("/")
    repo_id, _, url_revision = rest.partition("@")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise LoadError(f"{source}: expected hf://<org>/<name>[@<revision>]")
    if url_revision and revision and url_revision != revision:
        raise LoadError(f"{source}: revision {revision!r} contradicts @{url_revision}")
    return repo_id, url_revision or revision


def download_hf(
    source: str, revision: str | None, gguf_file: str | None, allow: list[str] | None = None
) -> Path:
    """Download an hf:// model with huggingface_hub (token from $HF_TOKEN).

    ``allow`` limits the download to matching files (the gate sidecar needs
    only the tokenizer's).
    """
    from huggingface_hub import snapshot_download

    repo_id, rev = parse_hf_source(source, revision)
    # A GGUF repo holds many quantizations; fetch only the one asked for.
    allow = [gguf_file] if gguf_file else allow
    log.info("downloading %s (revision %s)", repo_id, rev or "default")
    try:
        path = snapshot_download(
            repo_id, revision=rev, token=os.environ.get("HF_TOKEN") or None, allow_patterns=allow
        )
    except Exception as error:  # huggingface_hub raises many types; all mean "not available"
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes", "on"}
        hint = " (HF_HUB_OFFLINE is set and it is not in the local cache)" if offline else ""
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise LoadError(
            f"{source}: cannot download{hint}: {type(error).__name__}: {first}"
        ) from None
    return Path(str(path))


def locate(path: Path, gguf_file: str | None, source: str) -> ResolvedSource:
    """Check that ``path`` holds a loadable model and say which GGUF file, if any."""
    if path.is_file():
        if path.suffix != ".gguf":
            raise LoadError(f"{source}: a file source must be a .gguf file")
        if gguf_file is not None and gguf_file != path.name:
            raise LoadError(f"{source}: gguf_file {gguf_file!r} given for a .gguf file source")
        return ResolvedSource(path.parent, path.name)
    if not path.exists():
        raise LoadError(f"{source}: no such file or directory ({path})")
    if not path.is_dir():
        raise LoadError(f"{source}: not a directory or a .gguf file ({path})")
    if gguf_file is not None:
        if not (path / gguf_file).is_file():
            raise LoadError(f"{source}: gguf_file {gguf_file!r} not found in {path}")
        return ResolvedSource(path, gguf_file)
    if (path / "config.json").is_file():
        return ResolvedSource(path, None)
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if len(ggufs) == 1:  # a directory holding one GGUF file means that file
        return ResolvedSource(path, ggufs[0])
    if ggufs:
        raise LoadError(f"{source}: several .gguf files in {path}; name one with gguf_file")
    raise LoadError(f"{source}: no config.json in {path} (not a Hugging Face model directory)")


def resolve_source(spec: ModelSpec) -> ResolvedSource:
    """Map a ModelSpec's source to local files, downloading hf:// sources."""
    source = spec.source
    if source.startswith("hf://"):
        return locate(download_hf(source, spec.revision, spec.gguf_file), spec.gguf_file, source)
    if spec.revision is not None:
        raise LoadError(f"{source}: revision is only supported for hf:// sources")
    if source.startswith("pvc://"):
        return locate(pvc_path(source), spec.gguf_file, source)
    if "://" in source:
        raise LoadError(f"{source}: unknown scheme (use a path, pvc:// or hf://)")
    return locate(Path(source).expanduser(), spec.gguf_file, source)


def prepare_model(
    model: Any,
    device: torch.device,
    quantization: Quantization = "none",
    *,
    cpu_kernels: CpuKernels = "onednn",
    keep_plain: bool = False,
) -> Any:
    """The one-time rewrites the engine runs on; returns the model to use.

    Fused q/k/v and gate/up projections first, so that quantizing and
    prepacking see one linear per fused projection; then, on the CPU only,
    the backend's quantization and kernels (``engine/cpu/prepare.py``).
    ``keep_plain`` keeps the plain fp32 weights beside the packed ones (the
    benchmark's stock-kernel baseline). Applying it twice is harmless.
    """
    fuse_projections(model)
    if device.type != "cpu":
        return model
    from specpair_runtime.engine.cpu.prepare import prepare_cpu_model

    return prepare_cpu_model(model, quantization, kernels=cpu_kernels, keep_plain=keep_plain)


def _load_tokenizer(resolved: ResolvedSource, source: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            str(resolved.directory), gguf_file=resolved.gguf_file, local_files_only=True
        )
    except (OSError, ValueError, KeyError) as error:
        raise LoadError(f"{source}: cannot load the tokenizer: {_first_line(error)}") from None


def _load_weights(
    resolved: ResolvedSource, dtype: torch.dtype, device: torch.device, source: str
) -> Any:
    from transformers import AutoModelForCausalLM

    # On CUDA, place weights straight on the device instead of staging them in host RAM.
    placement = {"device_map": str(device)} if device.type == "cuda" else {}
    try:
        return AutoModelForCausalLM.from_pretrained(
            str(resolved.directory),
            gguf_file=resolved.gguf_file,
            dtype=dtype,
            local_files_only=True,
            **placement,
        )
    except (OSError, ValueError, KeyError) as error:
        raise LoadError(f"{source}: cannot load the model: {_first_line(error)}") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def load_model(
    spec: ModelSpec, role: Role, device: str | None = None, *, keep_plain: bool = False
) -> LoadedModel:
    """Load one model of the pair onto ``device`` (default: CUDA if present, else CPU).

    ``keep_plain``: see ``prepare_model``.
    """
    if role == "target" and spec.quantization != "none":
        raise LoadError(
            f"target.quantization must be 'none', got {spec.quantization!r}: only the draft "
            "may be quantized, so the output keeps the target's distribution"
        )
    torch_device = resolve_device(device)
    dtype = resolve_dtype(spec.dtype, torch_device)
    if spec.quantization != "none":
        if torch_device.type != "cpu":
            raise LoadError(
                f"{role}.quantization {spec.quantization} runs on the CPU only, "
                f"device is {torch_device}"
            )
        if dtype != torch.float32:
            raise LoadError(
                f"{role}.quantization {spec.quantization} needs dtype float32, got {dtype}"
            )
    resolved = resolve_source(spec)
    started = time.perf_counter()
    tokenizer = _load_tokenizer(resolved, spec.source)
    model = _load_weights(resolved, dtype, torch_device, spec.source)
    if resolved.gguf_file is not None:  # a GGUF names one EOS; the model may end on others
        add_end_of_generation(model, tokenizer)
    model.eval()
    model.requires_grad_(False)
    model.to(torch_device)
    model = prepare_model(model, torch_device, spec.quantization, keep_plain=keep_plain)
    name = resolved.gguf_file or resolved.directory.name
    log.info(
        "loaded %s %s (%s, %s%s) in %.1fs",
        role,
        name,
        torch_device,
        str(dtype).removeprefix("torch."),
        "" if spec.quantization == "none" else f", {spec.quantization}",
        time.perf_counter() - started,
    )
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=torch_device,
        dtype=dtype,
        name=name,
        source=spec.source,
        quantization=spec.quantization,
    )
