"""The model's shape, read from a Hugging Face `config.json`.

One decoder family is supported: Llama 2/3, Mistral, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k
RMSNorm, explicit head_dim). Anything else is refused with a ValueError naming the architecture.

Mistral's sliding window is accepted but not applied: attention is always full. That is exact while
sequences stay within the window (always the case when the window is at least the context length);
beyond it, outputs differ from the reference implementation.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_SCALING = ("llama3", "linear")

_ARCH_BY_CLASS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str = "float32"
    sliding_window: int | None = None

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        """Read `<path>/config.json`; EOS ids listed in `generation_config.json` are added to its own."""
        path = Path(path)
        with open(path / "config.json", encoding="utf-8") as f:
            cfg = cls.from_hf_dict(json.load(f))
        gen_path = path / "generation_config.json"
        if not gen_path.exists():
            return cfg
        with open(gen_path, encoding="utf-8") as f:
            gen_eos = _as_id_tuple(json.load(f).get("eos_token_id"))
        return replace(cfg, eos_token_ids=tuple(dict.fromkeys(cfg.eos_token_ids + gen_eos)))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from the dict of a Hugging Face `config.json`; raises ValueError if unsupported."""
        arch = _arch_of(d)
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is supported")
        heads = d["num_attention_heads"]
        hidden = d["hidden_size"]
        # Newer checkpoints nest theta and scaling under "rope_parameters".
        rope = d.get("rope_parameters") or {}
        rope_scaling = _check_rope_scaling(d.get("rope_scaling") or rope)
        cfg = cls(
            arch=arch,
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or hidden // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=d.get("rope_theta") or rope.get("rope_theta", 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=_has_attention_bias(arch, d),
            qk_norm=arch == "qwen3",
            eos_token_ids=_as_id_tuple(d.get("eos_token_id")),
            bos_token_id=d.get("bos_token_id"),
            torch_dtype=d.get("torch_dtype") or d.get("dtype") or "float32",
            sliding_window=_sliding_window(d),
        )
        if cfg.num_heads % cfg.num_kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {cfg.num_kv_heads}")
        return cfg


def _arch_of(d: dict[str, Any]) -> str:
    model_type = d.get("model_type", "")
    if model_type in SUPPORTED_ARCHS:
        return model_type
    for cls_name in d.get("architectures") or ():
        if cls_name in _ARCH_BY_CLASS:
            return _ARCH_BY_CLASS[cls_name]
    name = model_type or ",".join(d.get("architectures") or ()) or "<none>"
    raise ValueError(f"unsupported model architecture {name!r}; supported: {', '.join(SUPPORTED_ARCHS)}")


def _check_rope_scaling(rs: dict[str, Any] | None) -> dict[str, Any] | None:
    if not rs:
        return None
    kind = rs.get("rope_type") or rs.get("type")
    if kind in (None, "default"):
        return None
    if kind not in SUPPORTED_ROPE_SCALING:
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: {', '.join(SUPPORTED_ROPE_SCALING)}")
    return {**rs, "rope_type": kind}


def _has_attention_bias(arch: str, d: dict[str, Any]) -> bool:
    if arch == "qwen2":
        return True
    return bool(d.get("attention_bias", False))


def _sliding_window(d: dict[str, Any]) -> int | None:
    window = d.get("sliding_window")
    if not d.get("use_sliding_window", True):
        return None
    if window is None or window >= d.get("max_position_embeddings", 0):
        return None
    log.warning(
        "sliding_window=%d is not applied: attention is full, so outputs differ from the reference beyond %d tokens",
        window,
        window,
    )
    return window


def _as_id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(value)
