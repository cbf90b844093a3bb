"""A pair with the real Qwen2.5-Coder pair's architecture and random weights.

What a forward costs depends on the shapes and the kernels, not on the
weights' values. Where the real pair cannot be fetched (a GPU machine with no
network, say), ``make gpu-check`` still measures the cost curve of the pair's
architecture on this pair (``bench/bench_forward.py --shaped-pair``). Its
tokens mean nothing, so nothing that depends on acceptance (speedups, output
identity) is measured on it.

The shapes are those of the converted real pair's ``config.json``
(``tests/unit/test_shaped_pair.py`` checks them against it where it is cached).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from tools.fetch_models import cached_pair_or_report
from tools.tiny_models import build_tokenizer, save_model, special_token_ids

if TYPE_CHECKING:
    from tools.fetch_models import Role


@dataclass(frozen=True)
class QwenShape:
    """The ``config.json`` fields that set a Qwen2 model's tensor shapes."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int = 151936
    # The GGUF files carry an output matrix of its own, so the converted pair ties none.
    tie_word_embeddings: bool = False


REAL_PAIR_SHAPES: Mapping[Role, QwenShape] = {
    # Qwen2.5-Coder-1.5B-Instruct and -0.5B-Instruct.
    "target": QwenShape(1536, 8960, 28, 12, 2),
    "draft": QwenShape(896, 4864, 24, 14, 2),
}


def shaped_config(
    shape: QwenShape, dtype: torch.dtype, tokenizer: PreTrainedTokenizerFast
) -> Qwen2Config:
    """A Qwen2 config of ``shape`` whose special tokens are ``tokenizer``'s."""
    return Qwen2Config(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        vocab_size=shape.vocab_size,
        tie_word_embeddings=shape.tie_word_embeddings,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        **special_token_ids(tokenizer),
        dtype=dtype,
    )


def write_shaped_pair(
    root: Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    shapes: Mapping[Role, QwenShape] = REAL_PAIR_SHAPES,
) -> dict[Role, Path]:
    """Write ``root/target`` and ``root/draft``: the real pair's shapes, seeded random weights.

    Both share the tiny built-in tokenizer (its ids are a subset of the
    models' vocabulary), so the pair passes the alignment check.
    """
    tokenizer = build_tokenizer()
    # Drawing 2 billion random weights is quicker on a GPU, where there is one.
    init_device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dirs: dict[Role, Path] = {}
    for offset, (role, shape) in enumerate(shapes.items()):
        torch.manual_seed(seed + offset)
        with init_device:
            model = Qwen2ForCausalLM(shaped_config(shape, dtype, tokenizer))
            torch.nn.Module.to(model, dtype)  # transformers' typed ``to`` hides this overload
        dirs[role] = save_model(model, tokenizer, root / role)
        del model
    return dirs


@contextmanager
def bench_pair(*, shaped: bool) -> Iterator[dict[Role, Path] | None]:
    """The pair a benchmark runs on, for the block's duration.

    ``shaped``: this module's pair, written to a scratch folder that the block
    removes; otherwise the cached real pair, or None (with the reason printed)
    where it is not cached.
    """
    if not shaped:
        yield cached_pair_or_report()
        return
    with tempfile.TemporaryDirectory(prefix="shaped-pair-") as scratch:
        yield write_shaped_pair(Path(scratch))
