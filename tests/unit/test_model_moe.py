"""DeepSeek-V3 and Qwen3-MoE shapes read from their real config.json, the routers' choices, the latent
KV pool, and how tensor parallelism splits MLA and experts."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_worker.mem.kv_pool import KVKind, KVPool
from disagg_worker.model.config import ModelConfig, MoEConfig
from disagg_worker.model.moe import Router
from disagg_worker.model.parallel import Shard, check_parallel, shard_slice

DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3's config.json, the keys that shape the model
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
}
QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B's config.json
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def test_deepseek_v3_reads_as_mla_with_routed_and_shared_experts():
    cfg = ModelConfig.from_hf_dict(DEEPSEEK_V3)
    assert cfg.arch == "deepseek_v3" and cfg.mla is not None and cfg.moe is not None
    assert (cfg.kv_num_heads, cfg.kv_head_dim, cfg.rope_dim) == (1, 576, 64)
    assert cfg.moe.layers == tuple(range(3, 61)) and cfg.nextn_layers == 1
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.n_group, cfg.moe.topk_group) == (256, 8, 8, 4)
    assert (
        cfg.moe.scoring == "sigmoid"
        and cfg.moe.routed_scaling_factor == 2.5
        and cfg.moe.shared_intermediate_size == 2048
    )
    mscale = 0.1 * math.log(40) + 1
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * mscale * mscale)
    # The cache holds 576 values per token and layer: 70 KB per token in bfloat16, where per-head K and V of
    # 128 heads x 192/128 dims would take 40 times as much.
    assert cfg.num_layers * cfg.kv_head_dim * 2 == 70272


def test_qwen3_moe_reads_as_gqa_with_softmax_experts_on_every_layer():
    cfg = ModelConfig.from_hf_dict(QWEN3_30B_A3B)
    assert cfg.mla is None and cfg.qk_norm and cfg.moe is not None and cfg.moe.scoring == "softmax"
    assert cfg.moe.layers == tuple(range(48)) and cfg.moe.num_shared_experts == 0
    assert (cfg.kv_num_heads, cfg.kv_head_dim) == (4, 128)
    sparse = ModelConfig.from_hf_dict({**QWEN3_30B_A3B, "decoder_sparse_step": 2, "mlp_only_layers": [1]})
    assert sparse.moe is not None and sparse.moe.layers == tuple(range(3, 48, 2))


@pytest.mark.parametrize(
    "d,needle",
    [
        ({**DEEPSEEK_V3, "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"]}, "'deepseek_v2'"),
        ({**DEEPSEEK_V3, "topk_method": "greedy"}, "noaux_tc"),
        ({**DEEPSEEK_V3, "rope_scaling": {"type": "longrope", "factor": 2}}, "'longrope'"),
    ],
    ids=["deepseek-v2", "v3-greedy-routing", "longrope"],
)
def test_what_is_not_supported_is_refused_by_name(d, needle):
    with pytest.raises(ValueError, match=needle):
        ModelConfig.from_hf_dict(d)


def test_mla_splits_heads_over_tp_and_replicates_the_latent_projections():
    cfg = ModelConfig.from_hf_dict(DEEPSEEK_V3)
    s = Shard(tp_rank=1, tp_size=8)
    assert s.kv_heads(cfg) == range(0, 1)  # every rank caches the whole latent
    per = 16  # heads per rank
    assert shard_slice("model.layers.0.self_attn.q_b_proj.weight", (128 * 192, 1536), cfg, s)[0] == slice(
        per * 192, 2 * per * 192
    )
    assert shard_slice("model.layers.0.self_attn.kv_b_proj.weight", (128 * 256, 512), cfg, s)[0] == slice(
        per * 256, 2 * per * 256
    )
    assert shard_slice("model.layers.0.self_attn.o_proj.weight", (7168, 128 * 128), cfg, s)[1] == slice(
        per * 128, 2 * per * 128
    )
    for name, shape in [
        ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", (576, 7168)),
        ("model.layers.0.self_attn.q_a_proj.weight", (1536, 7168)),
        ("model.layers.5.mlp.gate.weight", (256, 7168)),
        ("model.layers.5.mlp.gate.e_score_correction_bias", (256,)),
    ]:
        assert all(sl == slice(None) for sl in shard_slice(name, shape, cfg, s)), name
    assert shard_slice("model.layers.5.mlp.experts.17.up_proj.weight", (2048, 7168), cfg, s)[0] == slice(256, 512)
    assert shard_slice("model.layers.5.mlp.experts.17.down_proj.weight", (7168, 2048), cfg, s)[1] == slice(256, 512)
    assert shard_slice("model.layers.5.mlp.shared_experts.gate_proj.weight", (2048, 7168), cfg, s)[0] == slice(256, 512)
    assert shard_slice("model.layers.1.mlp.gate_proj.weight", (18432, 7168), cfg, s)[0] == slice(2304, 4608)


def test_tp_sizes_that_do_not_divide_the_experts_are_named():
    cfg = ModelConfig.from_hf_dict({**DEEPSEEK_V3, "moe_intermediate_size": 2049, "n_shared_experts": 0})
    assert "expert MLP size 2049" in check_parallel(cfg, 2, 1)
    assert check_parallel(ModelConfig.from_hf_dict(DEEPSEEK_V3), 8, 4) == ""


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(1, 12))
def test_grouped_routing_picks_top_k_inside_the_best_groups(seed, tokens):
    moe = MoEConfig(
        num_experts=16,
        top_k=4,
        intermediate_size=8,
        layers=(0,),
        scoring="sigmoid",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    )
    router = Router(8, moe)
    g = torch.Generator().manual_seed(seed)
    router.weight.data = torch.randn(16, 8, generator=g)
    router.e_score_correction_bias.data = torch.randn(16, generator=g) * 0.1
    x = torch.randn(tokens, 8, generator=g)
    weights, ids = router(x)
    choice = (router.weight @ x.T).T.sigmoid() + router.e_score_correction_bias
    for t in range(tokens):
        group_score = choice[t].view(4, 4).topk(2, dim=-1)[0].sum(-1)
        best_groups = set(group_score.topk(2)[1].tolist())
        assert {e // 4 for e in ids[t].tolist()} <= best_groups
        allowed = [e for e in range(16) if e // 4 in best_groups]
        top = sorted(allowed, key=lambda e: -choice[t, e].item())[:4]
        assert sorted(ids[t].tolist()) == sorted(top)
    torch.testing.assert_close(weights.sum(-1), torch.full((tokens,), 2.5))


def test_latent_pool_has_one_buffer_per_layer_and_no_k_or_v():
    pool = KVPool(3, 5, 4, 1, 40, torch.float32, kind=KVKind.MLA)
    assert [b.shape for b in pool.buffers()] == [(5, 4, 1, 40)] * 3
    assert pool.buffers()[1] is pool.latent_buffer(1) and pool.nbytes == 3 * 5 * pool.page_nbytes
    with pytest.raises(TypeError, match="no mha buffers"):
        pool.k_buffer(0)
    with pytest.raises(ValueError, match="one latent"):
        KVPool(3, 5, 4, 2, 40, torch.float32, kind=KVKind.MLA)


def test_expert_parallelism_gives_each_rank_its_experts_whole():
    cfg = ModelConfig.from_hf_dict(DEEPSEEK_V3)
    s = Shard(tp_rank=1, tp_size=8, ep_size=8)
    assert s.experts(256) == range(32, 64)
    assert all(
        sl == slice(None) for sl in shard_slice("model.layers.5.mlp.experts.40.up_proj.weight", (2048, 7168), cfg, s)
    )
    assert shard_slice("model.layers.5.mlp.experts.17.up_proj.weight", (2048, 7168), cfg, s) is None
    # shared experts and dense layers stay sliced by TP
    assert shard_slice("model.layers.5.mlp.shared_experts.up_proj.weight", (2048, 7168), cfg, s)[0] == slice(256, 512)
    assert check_parallel(cfg, 8, 1, 8) == ""
    assert "does not divide the 256 routed experts" in check_parallel(cfg, 3, 1, 3)
    dense = ModelConfig.from_hf_dict(QWEN3_30B_A3B | {"num_experts": 0, "model_type": "qwen3"})
    assert "no experts" in check_parallel(dense, 2, 1, 2)
    with pytest.raises(ValueError, match="ep_size 2 must be 1 or the tp_size 4"):
        Shard(tp_size=4, ep_size=2)


def test_ep_size_other_than_1_or_tp_size_stops_the_start_up_naming_the_flag():
    from disagg_worker.config import ConfigError, DisaggConfig

    with pytest.raises(ConfigError, match="--ep-size 2 must be 1 or equal --tp-size 4"):
        DisaggConfig(tp_size=4, ep_size=2)


def test_expert_counts_under_the_key_transformers_5_writes_are_read():
    d = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"} | {"num_local_experts": 128}
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.moe is not None and cfg.moe.num_experts == 128
    v3 = {k: v for k, v in DEEPSEEK_V3.items() if k != "n_routed_experts"} | {"num_local_experts": 256}
    assert ModelConfig.from_hf_dict(v3).moe.num_experts == 256  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="attention_bias"):
        ModelConfig.from_hf_dict({**DEEPSEEK_V3, "attention_bias": True})
