"""Our paged forward gives the same logits and greedy tokens as `transformers` on the same weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from disagg_worker.model.loader import load_model
from disagg_worker.model.tiny import make_tiny
from tests.unit.model_stubs import (
    ARCHS,
    PageAllocator,
    make_batch,
    model_pool,
)

PAGE_SIZE = 4
ATOL = 1e-4
PROMPTS = [
    [5, 17, 300, 42, 9, 1500, 77, 8, 640, 12, 33],
    [900, 4, 250, 61],
    [7, 1024, 88, 19, 2000, 3, 45, 66, 120, 230, 11, 404, 505, 606, 70, 71, 72],
]

pytest_plugins = ["tests.unit.conftest_model"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models(tiny_dirs):
    out = {}
    for arch in ARCHS:
        ours, cfg = load_model(tiny_dirs[arch], "float32", "cpu")
        ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], dtype=torch.float32).eval()
        out[arch] = (ours, cfg, ref)
    return out


def ref_last_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0, -1].float()


def new_pool(cfg, seed: int = 0):
    return model_pool(cfg, num_pages=64, page_size=PAGE_SIZE), PageAllocator(64, seed)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_of_several_prompts_matches_transformers(models, arch):
    ours, cfg, ref = models[arch]
    kv, alloc = new_pool(cfg)
    seqs = [alloc.new_seq(32, PAGE_SIZE) for _ in PROMPTS]
    logits = ours(make_batch(seqs, PROMPTS, PAGE_SIZE), kv)
    assert logits.shape == (len(PROMPTS), cfg.vocab_size) and logits.dtype == torch.float32
    for i, prompt in enumerate(PROMPTS):
        torch.testing.assert_close(logits[i], ref_last_logits(ref, prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_with_cached_prefix_matches_transformers(models, arch):
    ours, cfg, ref = models[arch]
    kv, alloc = new_pool(cfg, seed=1)
    prompt = PROMPTS[2]
    seq = alloc.new_seq(32, PAGE_SIZE)
    first = ours(make_batch([seq], [prompt[:6]], PAGE_SIZE), kv)
    torch.testing.assert_close(first[0], ref_last_logits(ref, prompt[:6]), atol=ATOL, rtol=0)
    second = ours(make_batch([seq], [prompt[6:]], PAGE_SIZE), kv)
    torch.testing.assert_close(second[0], ref_last_logits(ref, prompt), atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_decode_of_different_lengths_matches_transformers(models, arch):
    ours, cfg, ref = models[arch]
    kv, alloc = new_pool(cfg, seed=2)
    seqs = [alloc.new_seq(32, PAGE_SIZE) for _ in PROMPTS]
    ours(make_batch(seqs, PROMPTS, PAGE_SIZE), kv)
    for step_tokens in ([11, 22, 33], [1200, 5, 808], [64, 65, 66]):
        batch = make_batch(seqs, [[t] for t in step_tokens], PAGE_SIZE)
        assert batch.is_decode
        logits = ours(batch, kv)
        for i, seq in enumerate(seqs):
            torch.testing.assert_close(logits[i], ref_last_logits(ref, seq.tokens), atol=ATOL, rtol=0)


def greedy(model, cfg, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Prefill all prompts in one batch, then decode them together; a sequence stops at EOS."""
    kv, alloc = new_pool(cfg, seed=3)
    seqs = [alloc.new_seq(len(p) + max_new, PAGE_SIZE) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    active, new = list(range(len(prompts))), [list(p) for p in prompts]
    eos = set(cfg.eos_token_ids)
    while active:
        logits = model(make_batch([seqs[i] for i in active], new, PAGE_SIZE), kv)
        nxt = logits.argmax(-1).tolist()
        for i, tok in zip(active, nxt, strict=True):
            outputs[i].append(tok)
        active = [i for i, tok in zip(active, nxt, strict=True) if tok not in eos and len(outputs[i]) < max_new]
        new = [[outputs[i][-1]] for i in active]
    return outputs


def greedy_as_transformers(ours, cfg, ref) -> list[list[int]]:
    """Our 16 greedy tokens of each of PROMPTS, asserted equal to transformers' `generate`."""
    got = greedy(ours, cfg, PROMPTS, max_new=16)
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        with torch.no_grad():
            out = ref.generate(
                torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=list(cfg.eos_token_ids)
            )
        assert tokens == out[0, len(prompt) :].tolist()
    return got


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_is_token_identical_to_transformers(models, arch):
    ours, cfg, ref = models[arch]
    got = greedy_as_transformers(ours, cfg, ref)
    assert len({t for tokens in got for t in tokens}) > 3, "greedy output of the tiny model is degenerate"


@pytest.mark.parametrize(
    "scaling",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "linear", "factor": 4.0},
    ],
)
def test_rope_scaling_matches_transformers(tiny_dirs, tmp_path, scaling):
    path = tmp_path / "scaled"
    shutil.copytree(tiny_dirs["llama"], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "rope_scaling": scaling, "rope_theta": 500000.0}))
    ours, cfg = load_model(path, torch.float32, "cpu")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = [(i * 37) % 2000 + 4 for i in range(150)]
    kv, alloc = new_pool(cfg)
    logits = ours(make_batch([alloc.new_seq(160, PAGE_SIZE)], [prompt], PAGE_SIZE), kv)
    torch.testing.assert_close(logits[0], ref_last_logits(ref, prompt), atol=ATOL, rtol=0)


def test_a_second_deepseek_shape_matches_transformers(tmp_path):
    """Queries by one projection, no YaRN, rotary halves not interleaved, one expert group, two shared experts,
    every layer MoE, v_head_dim unlike the nope dim: prefill, chunked prefill and decode, then greedy tokens."""
    from tests.integration.test_deepseek import WIDE

    path = make_tiny(tmp_path / "wide", arch="deepseek_v3", overrides=WIDE)
    ours, cfg = load_model(path, "float32", "cpu")
    assert cfg.mla is not None and cfg.mla.q_lora_rank is None and not cfg.mla.rope_interleave
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    kv, alloc = new_pool(cfg, seed=4)
    prompt = PROMPTS[2]
    seq = alloc.new_seq(32, PAGE_SIZE)
    ours(make_batch([seq], [prompt[:6]], PAGE_SIZE), kv)
    second = ours(make_batch([seq], [prompt[6:]], PAGE_SIZE), kv)
    torch.testing.assert_close(second[0], ref_last_logits(ref, prompt), atol=ATOL, rtol=0)
    step = ours(make_batch([seq], [[77]], PAGE_SIZE), kv)
    torch.testing.assert_close(step[0], ref_last_logits(ref, seq.tokens), atol=ATOL, rtol=0)
    greedy_as_transformers(ours, cfg, ref)


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_bfloat16_routers_pick_the_experts_transformers_picks(tiny_dirs, arch):
    """In bfloat16 the routers keep the reference's precision: DeepSeek-V3's weight and correction bias stay
    float32 (a rounded bias changes the choice), Qwen3-MoE's logits are taken in the model's dtype."""
    ours, cfg = load_model(tiny_dirs[arch], "bfloat16", "cpu")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], dtype=torch.bfloat16).eval()
    layer = cfg.moe.layers[0]
    gate, ref_gate = ours.model.layers[str(layer)].mlp.gate, ref.model.layers[layer].mlp.gate
    if arch == "deepseek_v3":
        assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
        gate.e_score_correction_bias.data = torch.randn(cfg.moe.num_experts, generator=torch.Generator().manual_seed(0))
        ref_gate.e_score_correction_bias.data = gate.e_score_correction_bias.data.clone()
    x = torch.randn(512, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        weights, ids = gate(x)
        _, ref_weights, ref_ids = ref_gate(x)
    assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
    assert weights.dtype == ref_weights.dtype
    torch.testing.assert_close(weights.gather(1, ids.argsort(-1)), ref_weights.gather(1, ref_ids.argsort(-1)))
