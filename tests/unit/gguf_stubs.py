"""GGUF files for the tests, laid out as llama.cpp's converter writes them.

`write_gguf` turns a Hugging Face config and state dict (the tiny models) into a GGUF file: llama.cpp's
tensor names, the Q/K rows of the `llama` architecture permuted (its converter's `permute`), its
metadata keys, and optionally the byte-level BPE tokenizer of a tiny model directory. The layout is
checked independently of our reader by loading the files with transformers' GGUF loader.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

Q = GGMLQuantizationType
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    base, _, kind = hf_name.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{kind}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{_LAYER[rest]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `LlamaModel.permute` (Hugging Face row order -> llama.cpp's)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    path: Path,
    config: dict[str, Any],
    weights: dict[str, torch.Tensor],
    qtype: GGMLQuantizationType = Q.F32,
    tokenizer_dir: Path | None = None,
    raw_tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
) -> Path:
    """Write the model; 2-D tensors whose rows fit `qtype`'s blocks are stored as `qtype`, the rest as F32.

    `raw_tensors` adds tensors as given bytes of a given type (for types gguf-py cannot quantise to).
    """
    arch = config["model_type"]
    w = GGUFWriter(str(path), arch)
    _add_model_metadata(w, config)
    if tokenizer_dir is not None:
        _add_tokenizer(w, tokenizer_dir)
    for name in sorted(weights):
        arr = weights[name].float().numpy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            arr = llama_cpp_permute(arr, config["num_attention_heads"])
        elif arch == "llama" and name.endswith("k_proj.weight"):
            arr = llama_cpp_permute(arr, config["num_key_value_heads"])
        _add_tensor(w, gguf_name(name), np.ascontiguousarray(arr), qtype)
    for name, (raw, kind) in (raw_tensors or {}).items():
        w.add_tensor(name, raw, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def random_quant_bytes(rows: int, cols: int, kind: GGMLQuantizationType, seed: int = 0) -> np.ndarray:
    """Blocks of `kind` holding random bytes below 0x40, so every float16 scale in them is finite."""
    block, size = GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    return rng.integers(0, 0x40, (rows, cols // block * size), dtype=np.uint8)


def _add_tensor(w: GGUFWriter, name: str, arr: np.ndarray, qtype: GGMLQuantizationType) -> None:
    block = GGML_QUANT_SIZES[qtype][0]
    if arr.ndim == 1 or qtype == Q.F32 or arr.shape[-1] % block:
        w.add_tensor(name, arr)
    elif qtype == Q.F16:
        w.add_tensor(name, arr.astype(np.float16))
    else:
        w.add_tensor(name, quantize(arr, qtype), raw_dtype=qtype)


def _add_model_metadata(w: GGUFWriter, c: dict[str, Any]) -> None:
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(c["vocab_size"])


def _add_tokenizer(w: GGUFWriter, tokenizer_dir: Path) -> None:
    """The byte-level BPE tokenizer of a tiny model directory, under `tokenizer.ggml.*`."""
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    tcfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[tcfg["bos_token"]])
    w.add_eos_token_id(vocab[tcfg["eos_token"]])
    w.add_add_bos_token(tcfg["add_bos_token"])
    w.add_chat_template(tcfg["chat_template"])
