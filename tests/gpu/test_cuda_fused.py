"""On CUDA the fused kernels (`model/triton_fused.py`) equal the torch path they replace, in float32 and bfloat16
(bfloat16 within one unit in the last place, nearly all bit for bit), and a model loaded on CUDA runs q/k/v and
gate/up as merged GEMMs (`model/merged.py`) with the CPU's float32 logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disagg_worker.mem.kv_pool import KVPool
from disagg_worker.model.layers import GatedMLP
from disagg_worker.model.llama import LlamaAttention
from disagg_worker.model.loader import load_model
from disagg_worker.model.rope import RotaryEmbedding
from disagg_worker.model.triton_fused import rms_norm, rope, silu_and_mul
from tests.unit.model_stubs import PageAllocator, make_batch

ULP = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-6, rtol=2**-7)}


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`layers.RMSNorm.forward`'s torch path, on whatever device x is."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def check(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, **ULP[dtype])
    if dtype == torch.bfloat16:  # rounding the same way: nearly every element bit for bit
        assert (got != expected).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, dim", [(1, 4096), (37, 4096), (5, 128), (3, 5120)])
def test_rms_norm_equals_the_torch_path_on_cuda(dtype, rows, dim):
    gen = torch.Generator(device="cuda").manual_seed(rows + dim)
    x = 3 * torch.randn(rows, dim, device="cuda", generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(dim, device="cuda", generator=gen)).to(dtype)
    check(rms_norm(x, w, 1e-5), torch_rms_norm(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, size", [(1, 14336), (19, 14336), (4, 300)])
def test_silu_and_mul_equals_the_torch_path_on_cuda(dtype, rows, size):
    gen = torch.Generator(device="cuda").manual_seed(rows + size)
    gate, up = (4 * torch.randn(rows, 2 * size, device="cuda", generator=gen)).to(dtype).split(size, -1)
    check(silu_and_mul(gate, up), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 33])
def test_rope_equals_the_torch_path_on_cuda(dtype, tokens):
    """Llama-3.1-8B's heads (32 q, 8 kv, 128 wide) as views into a merged q/k/v output."""
    from disagg_worker.model.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 14336,
            "num_hidden_layers": 1,
            "vocab_size": 32,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 8192,
            "rope_theta": 500000.0,
        }
    )
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    q, k, _ = torch.randn(tokens, 6144, device="cuda", generator=gen).to(dtype).split([4096, 1024, 1024], -1)
    q, k = q.view(tokens, 32, 128), k.view(tokens, 8, 128)
    positions = torch.randint(0, 8192, (tokens,), device="cuda", generator=gen)
    rotation = RotaryEmbedding(cfg).to("cuda").at(positions, dtype)
    cos, sin = rotation.cos, rotation.sin
    got = rope(q, k, cos, sin)
    for g, x in zip(got, (q, k), strict=True):  # the torch path, spelled out (Rotation calls the kernel on CUDA)
        half = x.shape[-1] // 2
        check(g, x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin, dtype)


def decode_logits(model, cfg, device: str) -> torch.Tensor:
    """A prefill of two prompts, then a decode step of each: the decode step's logits, on the CPU."""
    prompts = [[5, 17, 300, 42, 9, 1500, 77, 8], [3, 11, 250]]
    kv = KVPool(cfg.num_layers, 16, 4, cfg.kv_num_heads, cfg.kv_head_dim, torch.float32, device=device)
    alloc = PageAllocator(16)
    seqs = [alloc.new_seq(len(p) + 1, 4) for p in prompts]
    model(make_batch(seqs, prompts, 4), kv)
    return model(make_batch(seqs, [[7], [9]], 4), kv).cpu()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_a_model_loaded_on_cuda_merges_its_projections(tiny_models, arch):
    cuda, cfg = load_model(tiny_models[arch], "float32", "cuda")
    assert all(m.qkv is not None for m in cuda.modules() if isinstance(m, LlamaAttention))
    assert all(m.gate_up is not None for m in cuda.modules() if isinstance(m, GatedMLP))
    cpu, _ = load_model(tiny_models[arch], "float32", "cpu")
    assert cuda.state_dict().keys() == cpu.state_dict().keys()
    for name, value in cpu.state_dict().items():
        assert torch.equal(cuda.state_dict()[name].cpu(), value), name
    torch.testing.assert_close(decode_logits(cuda, cfg, "cuda"), decode_logits(cpu, cfg, "cpu"), atol=1e-4, rtol=1e-4)
