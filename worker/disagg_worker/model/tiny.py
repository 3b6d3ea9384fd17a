"""A tiny random-weight model in Hugging Face layout, for tests, demos and benchmarks without a download.

`make_tiny(out_dir)` writes `config.json`, `model.safetensors` (a few MB), a byte-level BPE
`tokenizer.json` trained on the corpus shipped in `disagg_worker/data/corpus.txt`,
`tokenizer_config.json` (ChatML chat template) and `generation_config.json`. The same seed gives
byte-identical files. `arch` picks the shape: "llama" (untied head), "qwen2" (q/k/v bias, tied
head), "qwen3" (q/k norm, explicit head_dim, tied head), "qwen3_moe" (Qwen3 attention, 8 experts
top-2, layer 0 dense) or "deepseek_v3" (MLA with a q low-rank projection, YaRN rotary, 8 routed
experts in 4 groups plus a shared one, layer 0 dense). Checkpoint names are the Hub's: one tensor
per expert (`mlp.experts.<e>.gate_proj.weight`).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from disagg_worker.model.config import ModelConfig
from disagg_worker.model.registry import build_model

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")
BOS_ID, EOS_ID, IM_END_ID = 0, 1, 3
WEIGHT_STD = 0.05

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is not string %}{{ raise_exception('message content must be a string') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_COMMON = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "torch_dtype": "float32",
    "initializer_range": WEIGHT_STD,
}
_ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "rope_scaling": None,
    },
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 4,
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "tie_word_embeddings": True,
        "head_dim": 64,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 4,
    },
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "tie_word_embeddings": False,
        "head_dim": 64,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
        "norm_topk_prob": True,
        "router_aux_loss_coef": 0.0,
    },
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "tie_word_embeddings": False,
        "num_key_value_heads": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "moe_intermediate_size": 64,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "rope_interleave": True,
        "attention_bias": False,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    },
}


def make_tiny(
    out_dir: str | Path, seed: int = 0, arch: str = "llama", num_kv_heads: int = 0, overrides: dict | None = None
) -> Path:
    """Write the tiny model to `out_dir` (created if needed) and return its path. `num_kv_heads`
    (0: the default, 2) changes the KV head count, e.g. 1 for multi-query attention; `overrides`
    replaces `config.json` keys (a differently shaped model of the same architecture)."""
    if arch not in _ARCH_CONFIGS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {', '.join(_ARCH_CONFIGS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_config = {**_COMMON, **_ARCH_CONFIGS[arch], **(overrides or {})}
    if num_kv_heads:
        hf_config["num_key_value_heads"] = num_kv_heads
    write_json(out / "config.json", hf_config)
    write_json(out / "generation_config.json", {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID]})
    write_json(out / "tokenizer_config.json", tokenizer_config(hf_config))
    train_tokenizer(VOCAB_SIZE).save(str(out / "tokenizer.json"))
    weights = random_weights(ModelConfig.from_hf_dict(hf_config), seed)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def make_draft(target: str | Path, out_dir: str | Path, seed: int = 0, num_layers: int = 1) -> Path:
    """Write a small random-weight Llama that can draft for the model at `target` (STANDALONE speculation in
    tests and benchmarks): the target's tokenizer and vocabulary, and its KV shape (KV heads x head_dim), so the
    draft's KV travels with the target's pages through P/D; as many query heads as KV heads, `num_layers`."""
    from disagg_worker.model.gguf_meta import open_gguf
    from disagg_worker.model.gguf_tokenizer import tokenizer_from_gguf
    from disagg_worker.model.loader import model_config
    from disagg_worker.model.source import find_gguf

    t = model_config(target)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gguf_file = find_gguf(target)
    if gguf_file is not None:
        tok, tcfg = tokenizer_from_gguf(open_gguf(gguf_file))
        tok.save(str(out / "tokenizer.json"))
        write_json(out / "tokenizer_config.json", tcfg)
    else:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (Path(target) / name).exists():
                (out / name).write_bytes((Path(target) / name).read_bytes())
    hf_config = {
        **_COMMON,
        **_ARCH_CONFIGS["llama"],
        "vocab_size": t.vocab_size,
        "hidden_size": t.num_kv_heads * t.head_dim,
        "intermediate_size": 2 * t.num_kv_heads * t.head_dim,
        "num_hidden_layers": num_layers,
        "num_attention_heads": t.num_kv_heads,
        "num_key_value_heads": t.num_kv_heads,
        "head_dim": t.head_dim,
        "max_position_embeddings": t.max_position_embeddings,
        "rope_theta": t.rope_theta,
        "bos_token_id": t.bos_token_id,
        "eos_token_id": list(t.eos_token_ids),
    }
    write_json(out / "config.json", hf_config)
    weights = random_weights(ModelConfig.from_hf_dict(hf_config), seed)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Every parameter of the model, normal(0, WEIGHT_STD); norm weights near 1. Tied heads are omitted."""
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in build_model(cfg).named_parameters()}
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name in sorted(shapes):
        noise = torch.randn(shapes[name], generator=gen) * WEIGHT_STD
        weights[name] = (1.0 + noise) if "norm" in name else noise
    return weights


def arches() -> tuple[str, ...]:
    return tuple(_ARCH_CONFIGS)


def corpus_text() -> str:
    return resources.files("disagg_worker").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE trained on the shipped corpus; `<s>` is prepended when special tokens are added."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text().splitlines(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return tok


def tokenizer_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": hf_config["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }


def write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
