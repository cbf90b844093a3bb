"""Write a tiny Llama as a GGUF file in code, the way llama.cpp's converter does.

Tensors are stored in float32 (no quantization), so loading the file back
through transformers must give exactly the original model's logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from transformers import PreTrainedModel, PreTrainedTokenizerFast

_TOP_LEVEL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_PER_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary layout for q/k rows (transformers undoes it when loading)."""
    shape = weights.shape
    split = weights.reshape(heads, 2, shape[0] // heads // 2, *shape[1:])
    return split.swapaxes(1, 2).reshape(shape)


def _gguf_name(name: str) -> tuple[str, str | None]:
    """GGUF tensor name, and which rotary permutation (q/k) it needs."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name], None
    parts = name.split(".")  # model.layers.<n>.<module path>.weight
    module = ".".join(parts[3:-1])
    kind = {"self_attn.q_proj": "q", "self_attn.k_proj": "k"}.get(module)
    return f"blk.{parts[2]}.{_PER_LAYER[module]}.{parts[-1]}", kind


def _write_tokenizer(writer: gguf.GGUFWriter, tokenizer: PreTrainedTokenizerFast) -> None:
    vocab = tokenizer.get_vocab()
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = set(tokenizer.all_special_tokens)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")  # byte-level BPE
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_bos_token_id(int(tokenizer.bos_token_id))
    writer.add_eos_token_id(int(tokenizer.eos_token_id))
    writer.add_pad_token_id(int(tokenizer.pad_token_id))
    if tokenizer.chat_template:
        writer.add_chat_template(str(tokenizer.chat_template))


def write_llama_gguf(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, path: Path
) -> Path:
    """Write ``model`` (an untied tiny Llama) and ``tokenizer`` as one float32 GGUF file."""
    config: Any = model.config
    rope = config.rope_parameters or {}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(path.stem)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _write_tokenizer(writer, tokenizer)
    heads = {"q": config.num_attention_heads, "k": config.num_key_value_heads}
    for name, tensor in model.state_dict().items():
        array = tensor.detach().float().numpy()
        gguf_name, rotary = _gguf_name(name)
        if rotary is not None:
            array = _permute(array, heads[rotary])
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
