"""The model's shape, read from a Hugging Face `config.json`.

Supported: the Llama family (Llama 2/3, Mistral, Qwen2 with q/k/v bias, Qwen3 with per-head q/k
RMSNorm), Qwen3-MoE (Qwen3 attention, softmax top-k experts) and DeepSeek-V3 (multi-head latent
attention, `MLAConfig`; sigmoid grouped top-k experts with shared experts, `MoEConfig`). The
architecture comes from `model_type`, else from `architectures`; anything else is refused with a
ValueError naming it. `model/registry.py` maps each to its module.

Mistral's sliding window is accepted but not applied: attention is always full. That is exact while
sequences stay within the window (always the case when the window is at least the context length);
beyond it, outputs differ from the reference implementation.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")
SUPPORTED_ROPE_SCALING = ("llama3", "linear", "yarn")

_ARCH_BY_CLASS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): K and V of every head are projected up from one
    per-token latent of `kv_lora_rank` values, plus a `qk_rope_head_dim` rotary key shared by all heads;
    the KV cache holds only those `latent_dim` values per token."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: queries by one projection, else through a low-rank one
    rope_interleave: bool = True  # rotary pairs are (x0, x1), (x2, x3)... as DeepSeek's weights lay them out

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts (and shared ones) in place of the MLP of the layers in `layers`.

    `scoring` "softmax" (Qwen3-MoE: top-k of the softmax) or "sigmoid" (DeepSeek-V3: sigmoid scores, the
    top-k chosen by score + `e_score_correction_bias` among the best `topk_group` of `n_group` groups,
    weighted by the plain scores)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    layers: tuple[int, ...]
    scoring: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1

    @property
    def shared_intermediate_size(self) -> int:
        return self.intermediate_size * self.num_shared_experts


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
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    # DeepSeek-V3's next-token-prediction layers, stored after the decoder's (not run by the decoder).
    nextn_layers: int = 0

    @property
    def rope_dim(self) -> int:
        """Dimensions each rotary embedding rotates: the head, or MLA's rotary part."""
        return self.mla.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def kv_num_heads(self) -> int:
        """Heads the KV cache holds per token: the KV heads, or MLA's one latent (shared by every head)."""
        return 1 if self.mla else self.num_kv_heads

    @property
    def kv_head_dim(self) -> int:
        """Values per cached head: head_dim, or MLA's latent width."""
        return self.mla.latent_dim if self.mla else self.head_dim

    @property
    def softmax_scale(self) -> float:
        """Attention's 1/sqrt(d), times YaRN's mscale(all dims) squared where the config asks for it."""
        d = self.mla.qk_head_dim if self.mla else self.head_dim
        scale = d**-0.5
        rs = self.rope_scaling or {}
        if rs.get("rope_type") == "yarn" and rs.get("mscale_all_dim"):
            m = yarn_mscale(rs["factor"], rs["mscale_all_dim"])
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.layers

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
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            eos_token_ids=_as_id_tuple(d.get("eos_token_id")),
            bos_token_id=d.get("bos_token_id"),
            torch_dtype=d.get("torch_dtype") or d.get("dtype") or "float32",
            sliding_window=_sliding_window(d),
            mla=_mla(d) if arch == "deepseek_v3" else None,
            moe=_moe(arch, d),
            nextn_layers=d.get("num_nextn_predict_layers", 0),
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


def _mla(d: dict[str, Any]) -> MLAConfig:
    return MLAConfig(
        kv_lora_rank=d["kv_lora_rank"],
        qk_nope_head_dim=d["qk_nope_head_dim"],
        qk_rope_head_dim=d["qk_rope_head_dim"],
        v_head_dim=d["v_head_dim"],
        q_lora_rank=d.get("q_lora_rank"),
        rope_interleave=bool(d.get("rope_interleave", True)),
    )


def _moe(arch: str, d: dict[str, Any]) -> MoEConfig | None:
    layers = range(d["num_hidden_layers"])
    if arch == "qwen3_moe":
        skip, step = set(d.get("mlp_only_layers") or ()), d.get("decoder_sparse_step", 1)
        experts = _num_experts(d, "num_experts")
        return MoEConfig(
            num_experts=_num_experts(d, "num_experts"),
            top_k=d["num_experts_per_tok"],
            intermediate_size=d["moe_intermediate_size"],
            layers=tuple(i for i in layers if i not in skip and experts > 0 and (i + 1) % step == 0),
            scoring="softmax",
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        )
    if arch == "deepseek_v3":
        if d.get("attention_bias"):
            raise ValueError("DeepSeek-V3 with attention_bias is not supported (its checkpoints have none)")
        if d.get("topk_method", "noaux_tc") != "noaux_tc" or d.get("scoring_func", "sigmoid") != "sigmoid":
            raise ValueError("DeepSeek-V3 routing other than topk_method 'noaux_tc' (sigmoid scores) is not supported")
        first_dense, freq = d.get("first_k_dense_replace", 0), d.get("moe_layer_freq", 1)
        return MoEConfig(
            num_experts=_num_experts(d, "n_routed_experts"),
            top_k=d["num_experts_per_tok"],
            intermediate_size=d["moe_intermediate_size"],
            layers=tuple(i for i in layers if i >= first_dense and i % freq == 0),
            scoring="sigmoid",
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            num_shared_experts=d.get("n_shared_experts") or 0,
            n_group=d.get("n_group") or 1,
            topk_group=d.get("topk_group") or 1,
        )
    return None


def _num_experts(d: dict[str, Any], key: str) -> int:
    """The routed experts, under the checkpoint's own key or the one transformers 5 writes."""
    n = d.get(key, d.get("num_local_experts"))
    if n is None:
        raise ValueError(f"config.json names no expert count ({key} or num_local_experts)")
    return int(n)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature factor for a context scaled by `factor`."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


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
