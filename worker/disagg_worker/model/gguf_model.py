"""Models in llama.cpp's GGUF format: the config and the dequantised weights of one file.

A GGUF holds what a Hugging Face directory spreads over several files: the shape (metadata keys such
as `llama.block_count`), the weights (often quantised, under llama.cpp's tensor names) and the
tokenizer (`tokenizer.ggml.*`, read by `gguf_tokenizer.py`). This module maps the first two onto
what the engine already loads: `hf_config` returns the dict a `config.json` would hold, and
`read_weights` returns the state dict under Hugging Face names, dequantised with
`gguf.quants.dequantize` to the engine's dtype. The file is read with `gguf.GGUFReader`.

Two ways in, one mapping:

- `--model X.gguf` (or a directory holding one `.gguf` and no `config.json`) loads the file
  directly at start-up, as vLLM and SGLang do: nothing is written anywhere.
- `disagg model convert-gguf X.gguf --out DIR` (`gguf_convert.py`) writes the same config, weights
  and tokenizer as a Hugging Face directory, which the safetensors loader maps in a fraction of the
  time. Reading a GGUF is slow in Python: `GGUFReader` builds a numpy view per metadata string (about
  100k of them for a 49k-token vocabulary) and dequantising runs in numpy. SmolLM2-135M (Q4_1, 98 MB)
  takes ~2 s to parse and ~1 s to dequantise per process, and `disagg serve --local` has four
  processes that read the model (the HTTP and scheduler process of prefill and of decode) on a
  machine that may have two cores. `make serve` therefore converts once and serves the directory;
  see the README for the measured start-up times of both.

llama.cpp stores the rows of the Q and K projections of the `llama` architecture interleaved per
head (its converter's `permute`, for its rotary kernel); `read_weights` restores Hugging Face's
order, so the engine's rotary embedding applies unchanged. Qwen2 and Qwen3 files are not permuted.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from tqdm import tqdm

from disagg_worker.model.config import ModelConfig
from disagg_worker.model.gguf_meta import UnsupportedGGUFError, end_of_turn_ids, field

_T = GGMLQuantizationType
SUPPORTED_TYPES = (
    *(_T.F32, _T.F16, _T.BF16),
    *(_T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0),
    *(_T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K),
)

# GGUF `general.architecture` -> the Hugging Face class of the same model.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_config(reader: GGUFReader) -> dict[str, Any]:
    """The `config.json` of the model in the file; raises UnsupportedGGUFError for what the engine cannot run."""
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedGGUFError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise UnsupportedGGUFError("per-frequency RoPE factors (rope_freqs.weight, Llama 3.1 style) are not supported")

    def key(name: str, *default: Any) -> Any:
        return field(reader, f"{arch}.{name}", *default)

    heads, hidden = key("attention.head_count"), key("embedding_length")
    return {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_act": "silu",
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _same_for_every_layer(key("attention.head_count_kv", heads)),
        "head_dim": key("attention.key_length", hidden // heads),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": key("rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(key("rope.scaling.type", None), key("rope.scaling.factor", None)),
        "max_position_embeddings": key("context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": end_of_turn_ids(reader),
        "torch_dtype": "float32",
    }


def check_tensor_types(reader: GGUFReader, path: str | Path) -> None:
    """Raise UnsupportedGGUFError naming every quantisation type in the file that cannot be dequantised."""
    bad: dict[str, list[str]] = {}
    for t in reader.tensors:
        if t.tensor_type not in SUPPORTED_TYPES:
            bad.setdefault(t.tensor_type.name, []).append(t.name)
    if bad:
        found = ", ".join(f"{len(names)} {kind} tensor(s) such as {names[0]}" for kind, names in bad.items())
        raise UnsupportedGGUFError(
            f"{path} uses quantisation type {', '.join(bad)}, which this engine cannot load ({found}); "
            f"supported types: {', '.join(t.name for t in SUPPORTED_TYPES)}"
        )


def hf_tensor_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`)."""
    base, _, kind = name.rpartition(".")
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{kind}"
    return None


def tensor_names(reader: GGUFReader) -> dict[str, str]:
    """GGUF name -> Hugging Face name; a tensor with no counterpart keeps its GGUF name (and fails the name check)."""
    return {t.name: hf_tensor_name(t.name) or t.name for t in reader.tensors}


def read_weights(
    reader: GGUFReader,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    where: Callable[[str, tuple[int, ...]], tuple[slice, ...] | None] | None = None,
    progress: bool = True,
) -> dict[str, torch.Tensor]:
    """Tensors dequantised to `dtype` on `device`, under their Hugging Face names. `where(name, shape)`
    picks the part of each tensor to keep (None: skip it, without dequantising); default: all, whole."""
    names = tensor_names(reader)
    state: dict[str, torch.Tensor] = {}
    with tqdm(reader.tensors, desc="dequantising GGUF weights", unit="tensor", disable=not progress) as bar:
        for t in bar:
            name = names[t.name]
            part = where(name, tuple(int(n) for n in reversed(t.shape))) if where else None
            if where is not None and part is None:
                continue
            w = _dequantized(t)
            if cfg.arch == "llama" and ".attn_q." in t.name:
                w = unpermute_rows(w, cfg.num_heads)
            elif cfg.arch == "llama" and ".attn_k." in t.name:
                w = unpermute_rows(w, cfg.num_kv_heads)
            if part is not None:
                w = w[part]
            state[name] = w.to(dtype=dtype, device=device)
    return state


def dequantized_nbytes(reader: GGUFReader) -> int:
    """Bytes of every tensor in float32, what dequantising produces."""
    return sum(int(t.n_elements) * 4 for t in reader.tensors)


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: per head it interleaves the two rotary halves (row pairs
    (i, i + d/2) become (2i, 2i + 1)); Hugging Face keeps the halves apart."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _dequantized(t: ReaderTensor) -> torch.Tensor:
    arr = dequantize(t.data, t.tensor_type)
    # F32 comes back as a view of the read-only memory map; everything else is a fresh array.
    return torch.from_numpy(arr if arr.flags.writeable else np.array(arr))


def _same_for_every_layer(value: int | list[int]) -> int:
    if isinstance(value, int):
        return value
    if len(set(value)) != 1:
        raise UnsupportedGGUFError(f"a different number of KV heads per layer ({value}) is not supported")
    return value[0]


def _rope_scaling(kind: str | None, factor: float | None) -> dict[str, Any] | None:
    if kind in (None, "none"):
        return None
    # ModelConfig refuses the kinds the engine does not apply, naming them.
    return {"rope_type": kind, "factor": factor}
