"""Tiny models and a tokenizer, built in code, offline and deterministic.

Tests use these instead of real weights:

- ``build_tokenizer()``: a byte-level BPE trained on a small built-in corpus,
  wrapped in ``PreTrainedTokenizerFast`` with BOS/EOS/PAD and a chat template.
- ``build_llama(...)`` / ``build_gpt2(...)``: random tiny causal LMs over it.
- ``build_pair(...)``: a target and a draft that partly agrees with it (the
  target's weights plus noise), so acceptance is neither 0 nor 1.
- ``save_pair(tmp_path)``: the pair in Hugging Face layout, for the loader,
  the CLI and the server.
- ``as_loaded(model, tokenizer, name)``: an in-memory model as a
  ``LoadedModel`` (CPU, float32), to build engines without the loader.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypedDict

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from specpair_runtime.engine.loading import CpuKernels, LoadedModel, prepare_model

ModelKind = Literal["llama", "gpt2"]

BOS = "<s>"
EOS = "</s>"
PAD = "<pad>"
CHAT_TOKENS = ("<|user|>", "<|assistant|>", "<|system|>", "<|end|>")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# Qwen2.5's tool format over the tiny markers: tools in the system turn, calls as
# <tool_call> blocks of JSON, results as <tool_response> blocks in a user turn.
TOOL_TOKENS = ("<tool_call>", "</tool_call>")
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}<|system|>"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    'Call a function as <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call><|end|>"
    "{%- elif messages[0]['role'] == 'system' %}<|system|>{{ messages[0]['content'] }}<|end|>"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "<|{{ message.role }}|>{{ message.content }}<|end|>"
    "{%- elif message.role == 'assistant' %}<|assistant|>"
    "{%- if message.content %}{{ message.content }}{% endif %}"
    "{%- for call in message.tool_calls %}"
    "{%- if call.function is defined %}{% set call = call.function %}{% endif %}"
    '\n<tool_call>\n{"name": "{{ call.name }}", "arguments": {{ call.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|end|>"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}<|user|>{% endif %}"
    "\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|end|>{% endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)
# JSON and call text, so that the tool tokenizer learns their merges.
TOOL_CORPUS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '{"answer": "yes", "items": [1, 2, 3], "nested": {"ok": true, "value": null}}',
    '{"name": "Ada", "age": 36, "tags": ["math", "engine"], "active": false}',
)

# Support-desk flavoured text so that BPE learns real merges (multi-character
# tokens, leading spaces), and a few non-ASCII characters so that multi-byte
# UTF-8 sequences split across tokens (incremental detokenization must cope).
CORPUS = [
    "Hello, how can I help you today?",
    "My order has not arrived yet and the tracking page shows no update.",
    "Please share your order number so that I can check the status.",
    "The package left our warehouse on Monday and should arrive within three days.",
    "I would like to return the shoes because they are too small.",
    "You can start a return from the orders page; the label is free.",
    "Thank you for your patience. Is there anything else I can do for you?",
    "The refund will appear on your card within five business days.",
    "Can I change the delivery address after the order is placed?",
    "Yes, as long as the parcel has not been shipped yet.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "Café, naïve, über, déjà vu — 東京 and ☕ are fine too.",
    "STOP here. The end. Done!",
    "one two three four five six seven eight nine ten",
    "the quick brown fox jumps over the lazy dog",
]


def build_tokenizer(
    vocab_size: int = 400,
    *,
    bos: str = BOS,
    eos: str = EOS,
    pad: str = PAD,
    chat_template: str | None = CHAT_TEMPLATE,
    extra_corpus: tuple[str, ...] = (),
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2/Qwen style) trained on the built-in corpus.

    Training is deterministic for a given corpus and vocab size. Vary
    ``vocab_size``, ``extra_corpus`` or the special tokens to get a tokenizer
    that differs from the default one (for alignment tests).
    """
    specials = [bos, eos, pad, *CHAT_TOKENS]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([*CORPUS, *extra_corpus] * 4, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        additional_special_tokens=list(CHAT_TOKENS),
    )
    if chat_template is not None:
        wrapped.chat_template = chat_template
    return wrapped


def build_tool_tokenizer(vocab_size: int = 420) -> PreTrainedTokenizerFast:
    """The tiny tokenizer with Qwen2.5's tool format.

    ``<tool_call>`` and ``</tool_call>`` are added tokens that are not special
    (as in Qwen's tokenizer: decoded text keeps them), and the chat template
    renders tools, assistant calls and tool results the way Qwen2.5's does.
    """
    tokenizer = build_tokenizer(
        vocab_size, chat_template=TOOL_CHAT_TEMPLATE, extra_corpus=TOOL_CORPUS
    )
    tokenizer.add_tokens(list(TOOL_TOKENS))
    return tokenizer


def _peaky(model: PreTrainedModel, seed: int, logit_scale: float) -> PreTrainedModel:
    """Re-initialise ``model`` from ``seed`` and sharpen its output logits.

    A default random init gives near-uniform logits whose top two values often
    differ by less than float noise, so a batched forward (other matmul
    shapes) could flip a greedy argmax and make greedy-identity tests flaky
    for reasons unrelated to speculation. Scaling the final norm (which feeds
    the LM head) by ``logit_scale`` spreads the logits over several units, so
    near-ties become practically impossible, while the sampled distributions
    keep a handful of likely tokens (useful for chi-square tests).
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1:  # norm weights
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.08)
        final_norm = _final_norm_weight(model)
        final_norm.mul_(logit_scale)
    model.eval()  # type: ignore[no-untyped-call]
    return model


def _final_norm_weight(model: PreTrainedModel) -> torch.nn.Parameter:
    if isinstance(model, (LlamaForCausalLM, Qwen2ForCausalLM)):
        weight: torch.nn.Parameter = model.model.norm.weight
        return weight
    if isinstance(model, GPT2LMHeadModel):
        gpt2_weight: torch.nn.Parameter = model.transformer.ln_f.weight
        return gpt2_weight
    raise TypeError(f"unsupported model class {type(model).__name__}")


class SpecialTokenIds(TypedDict):
    """The config fields that name a tokenizer's special tokens."""

    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None


def special_token_ids(tokenizer: PreTrainedTokenizerFast) -> SpecialTokenIds:
    """``tokenizer``'s special token ids, as a model config names them."""
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def _llama_layout(
    tokenizer: PreTrainedTokenizerFast,
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    vocab_padding: int = 0,
) -> dict[str, Any]:
    """Config fields that Llama and Qwen2 share, for a tiny model over ``tokenizer``."""
    return {
        "vocab_size": len(tokenizer) + vocab_padding,
        "hidden_size": hidden,
        "intermediate_size": hidden * 2,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        **special_token_ids(tokenizer),
    }


def build_llama(
    tokenizer: PreTrainedTokenizerFast,
    seed: int = 0,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab_padding: int = 0,
    logit_scale: float = 6.0,
) -> LlamaForCausalLM:
    """A random tiny Llama (RoPE, GQA, RMSNorm, untied head) over ``tokenizer``.

    ``vocab_padding`` adds embedding rows beyond the tokenizer's tokens, as
    real checkpoints do.
    """
    config = LlamaConfig(
        **_llama_layout(
            tokenizer,
            layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            vocab_padding=vocab_padding,
        )
    )
    torch.manual_seed(seed)
    return _peaky(LlamaForCausalLM(config), seed, logit_scale)  # type: ignore[return-value]


def build_qwen2(
    tokenizer: PreTrainedTokenizerFast,
    seed: int = 0,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    logit_scale: float = 6.0,
) -> Qwen2ForCausalLM:
    """A random tiny Qwen2: a Llama with biases on q/k/v, drawn here so they are not zero."""
    layout = _llama_layout(tokenizer, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads)
    config = Qwen2Config(**layout)
    torch.manual_seed(seed)
    model: Qwen2ForCausalLM = _peaky(Qwen2ForCausalLM(config), seed, logit_scale)  # type: ignore[assignment]
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.copy_(torch.randn(module.bias.shape, generator=generator) * 0.08)
    return model


def build_gpt2(
    tokenizer: PreTrainedTokenizerFast,
    seed: int = 0,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    vocab_padding: int = 0,
    logit_scale: float = 6.0,
) -> GPT2LMHeadModel:
    """A random tiny GPT-2 (learned absolute positions, tied head) over ``tokenizer``."""
    config = GPT2Config(
        vocab_size=len(tokenizer) + vocab_padding,
        n_positions=1024,
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        **special_token_ids(tokenizer),
    )
    torch.manual_seed(seed)
    return _peaky(GPT2LMHeadModel(config), seed, logit_scale)  # type: ignore[return-value]


def build_model(
    kind: ModelKind, tokenizer: PreTrainedTokenizerFast, seed: int = 0, **kwargs: int | float
) -> PreTrainedModel:
    if kind == "llama":
        return build_llama(tokenizer, seed, **kwargs)  # type: ignore[arg-type]
    if kind == "gpt2":
        return build_gpt2(tokenizer, seed, **kwargs)  # type: ignore[arg-type]
    raise ValueError(f"kind must be 'llama' or 'gpt2', got {kind!r}")


def noisy_copy(model: PreTrainedModel, noise: float, seed: int) -> PreTrainedModel:
    """A copy of ``model`` whose weight matrices get Gaussian noise.

    ``noise`` is relative to each matrix's standard deviation: 0 gives an
    identical draft (acceptance 1), around 1 a draft that mostly disagrees.
    """
    clone = type(model)(model.config)
    clone.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(clone.named_parameters(), key=lambda item: item[0]):
            if param.dim() >= 2:
                scale = float(param.std()) * noise
                param.add_(torch.randn(param.shape, generator=generator) * scale)
    clone.eval()  # type: ignore[no-untyped-call]
    return clone


@dataclass
class TinyPair:
    tokenizer: PreTrainedTokenizerFast
    target: PreTrainedModel
    draft: PreTrainedModel


def build_pair(
    kind: ModelKind = "llama",
    seed: int = 0,
    draft_noise: float = 0.08,
    *,
    independent_draft: bool = False,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> TinyPair:
    """A target and a draft over one tokenizer.

    By default the draft is the target plus weight noise (it agrees on most
    greedy tokens). ``independent_draft=True`` makes the draft an unrelated
    random model of the same shape: a draft that disagrees strongly.
    """
    tok = tokenizer if tokenizer is not None else build_tokenizer()
    target = build_model(kind, tok, seed)
    if independent_draft:
        draft = build_model(kind, tok, seed + 1000)
    else:
        draft = noisy_copy(target, draft_noise, seed + 1)
    return TinyPair(tokenizer=tok, target=target, draft=draft)


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, directory: Path) -> Path:
    """Write ``model`` and ``tokenizer`` to ``directory`` in Hugging Face layout."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def save_pair(
    tmp_path: Path,
    kind: ModelKind = "llama",
    seed: int = 0,
    draft_noise: float = 0.08,
    *,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> tuple[Path, Path]:
    """Build a pair (over ``tokenizer``, default ``build_tokenizer()``) and save it as
    ``tmp_path/target`` and ``tmp_path/draft``."""
    pair = build_pair(kind, seed, draft_noise, tokenizer=tokenizer)
    target_dir = save_model(pair.target, pair.tokenizer, tmp_path / "target")
    draft_dir = save_model(pair.draft, pair.tokenizer, tmp_path / "draft")
    return target_dir, draft_dir


def as_loaded(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    name: str,
    *,
    cpu_kernels: CpuKernels = "onednn",
) -> LoadedModel:
    """Wrap an in-memory tiny model like the loader does (CPU, float32, projections fused,
    prepacked linears). ``cpu_kernels="default"`` keeps PyTorch's linears, as on CUDA."""
    prepare_model(model, torch.device("cpu"), cpu_kernels=cpu_kernels)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        device=torch.device("cpu"),
        dtype=torch.float32,
        name=name,
        source=f"memory:{name}",
    )


# vLLM's CPU attention takes head sizes of 32 and more; the default tiny models have 16.
VLLM_GEOMETRY: dict[str, int] = {"hidden": 64, "heads": 2, "kv_heads": 2, "layers": 2}


def save_vllm_pair(tmp_path: Path, seed: int = 0, draft_noise: float = 0.05) -> tuple[Path, Path]:
    """A tiny Llama pair that vLLM's CPU build can serve, as ``tmp_path/target``, ``/draft``."""
    tokenizer = build_tokenizer()
    target = build_llama(tokenizer, seed, **VLLM_GEOMETRY)
    draft = noisy_copy(target, draft_noise, seed + 1)
    return (
        save_model(target, tokenizer, tmp_path / "target"),
        save_model(draft, tokenizer, tmp_path / "draft"),
    )
