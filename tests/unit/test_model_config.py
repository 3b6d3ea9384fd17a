"""ModelConfig from Hugging Face config.json dicts of the supported families, and clear refusals."""

from __future__ import annotations

import json

import pytest

from disagg_worker.model.config import ModelConfig

LLAMA3 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}
QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
    "eos_token_id": 151645,
    "bos_token_id": 151643,
    "use_sliding_window": False,
    "sliding_window": None,
    "attention_bias": False,
    "hidden_act": "silu",
}
MISTRAL = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
    "sliding_window": 4096,
    "eos_token_id": 2,
    "hidden_act": "silu",
}


def test_llama3_shape_and_scaling():
    cfg = ModelConfig.from_hf_dict(LLAMA3)
    assert (cfg.arch, cfg.head_dim, cfg.num_kv_heads) == ("llama", 128, 8)
    assert cfg.eos_token_ids == (128001, 128008, 128009)
    assert cfg.rope_scaling["rope_type"] == "llama3"
    assert not cfg.attention_bias and not cfg.qk_norm


def test_qwen3_explicit_head_dim_qk_norm_and_single_eos():
    cfg = ModelConfig.from_hf_dict(QWEN3)
    assert cfg.head_dim == 128 != cfg.hidden_size // cfg.num_heads
    assert cfg.qk_norm and cfg.tie_word_embeddings
    assert cfg.eos_token_ids == (151645,)


def test_qwen2_has_qkv_bias():
    d = {**QWEN3, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
    del d["head_dim"]
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.attention_bias and not cfg.qk_norm and cfg.head_dim == 64


def test_mistral_short_sliding_window_is_kept_and_long_one_dropped():
    assert ModelConfig.from_hf_dict(MISTRAL).sliding_window == 4096
    assert ModelConfig.from_hf_dict({**MISTRAL, "sliding_window": 32768}).sliding_window is None


def test_unsupported_architecture_names_it_and_the_supported_ones():
    with pytest.raises(ValueError, match=r"'gpt2'.*llama, mistral, qwen2, qwen3"):
        ModelConfig.from_hf_dict({**LLAMA3, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


def test_unsupported_rope_scaling_is_refused():
    with pytest.raises(ValueError, match="'longrope'"):
        ModelConfig.from_hf_dict({**LLAMA3, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})


def test_rope_parameters_layout_is_read():
    d = {k: v for k, v in LLAMA3.items() if k not in ("rope_theta", "rope_scaling")}
    cfg = ModelConfig.from_hf_dict({**d, "rope_parameters": {**LLAMA3["rope_scaling"], "rope_theta": 500000.0}})
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["factor"] == 8.0


def test_generation_config_eos_ids_are_added(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3, "eos_token_id": 151643}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    assert ModelConfig.from_hf_dir(tmp_path).eos_token_ids == (151643, 151645)
