"""Named shapes of real models for `random_model.make_random` (`disagg model make-random --shape NAME`): each a
Hugging Face `config.json` less its token ids, which come from the tokenizer written beside the weights. Plain
data, no torch, so that the command line can list them. A new shape is an entry here whose keys the engine's
`ModelConfig.from_hf_dict` reads; a "-mini" one keeps a real shape's structure at a size tests can write.
"""

from __future__ import annotations

from typing import Any

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "pretraining_tp": 1,
    "tie_word_embeddings": False,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        **LLAMA,
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": LLAMA3_ROPE,
        "rms_norm_eps": 1e-5,
    },
    # Llama-3.1-8B's structure (GQA 4:1, head_dim 128, llama3 rotary scaling) at a size tests can write.
    "llama-3.1-8b-mini": {
        **LLAMA,
        "vocab_size": 4096,
        "hidden_size": 256,
        "intermediate_size": 896,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rope_scaling": {**LLAMA3_ROPE, "original_max_position_embeddings": 1024},
        "rms_norm_eps": 1e-5,
    },
    # make_tiny's Llama shape, drawn the way this module draws weights.
    "tiny-llama": {
        **LLAMA,
        "vocab_size": 2048,
        "hidden_size": 128,
        "intermediate_size": 344,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-5,
    },
}
