"""Merged projections (`model/merged.py`): q/k/v and gate/up as one GEMM each give the logits the separate
projections give, and leave the state dict's names and values, and the parameters' memory, as they were. The
loader merges on CUDA only; here the merge is applied by hand to models loaded on the CPU in float32."""

from __future__ import annotations

import pytest
import torch

from disagg_worker.model.layers import GatedMLP
from disagg_worker.model.llama import LlamaAttention
from disagg_worker.model.loader import load_model
from disagg_worker.model.merged import merge_projections
from tests.unit.model_stubs import PageAllocator, make_batch, model_pool

pytestmark = pytest.mark.usefixtures("one_torch_thread")
pytest_plugins = ["tests.unit.conftest_model"]
PROMPTS = [[5, 17, 300, 42, 9, 1500, 77, 8], [3, 11, 250]]


def logits(model, cfg) -> torch.Tensor:
    """A prefill of two prompts, then one decode step of each: the decode step's logits."""
    kv = model_pool(cfg, num_pages=16, page_size=4, dtype=torch.float32)
    alloc = PageAllocator(16)
    seqs = [alloc.new_seq(len(p) + 1, 4) for p in PROMPTS]
    model(make_batch(seqs, PROMPTS, 4), kv)
    return model(make_batch(seqs, [[7], [9]], 4), kv)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_merged_projections_give_the_same_logits_and_state_dict(tiny_dirs, arch):
    model, cfg = load_model(tiny_dirs[arch], "float32", "cpu")
    before = logits(model, cfg)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    bytes_before = sum(
        p.untyped_storage().nbytes() for p in {p.untyped_storage().data_ptr(): p for p in model.parameters()}.values()
    )

    merged = merge_projections(model)
    attn = [m for m in model.modules() if isinstance(m, LlamaAttention)]
    mlps = [m for m in model.modules() if isinstance(m, GatedMLP)]
    assert merged == len(attn) + len(mlps) and all(m.qkv is not None for m in attn)
    assert all(m.gate_up is not None for m in mlps)
    assert merge_projections(model) == 0  # merged once
    after_state = model.state_dict()
    assert after_state.keys() == state.keys()
    for name, value in state.items():
        assert torch.equal(after_state[name], value), name
    a = attn[0]
    assert a.q_proj.weight.untyped_storage().data_ptr() == a.qkv.weight.untyped_storage().data_ptr()  # views
    if cfg.attention_bias:
        assert a.qkv.bias is not None and a.v_proj.bias.data_ptr() == a.qkv.bias[-a.v_proj.out_features :].data_ptr()
    storages = {p.untyped_storage().data_ptr(): p for p in model.parameters()}.values()
    assert sum(p.untyped_storage().nbytes() for p in storages) == bytes_before  # no extra memory
    torch.testing.assert_close(logits(model, cfg), before, atol=1e-5, rtol=1e-5)


def test_an_in_place_update_reaches_the_merged_weight(tiny_dirs):
    model, _ = load_model(tiny_dirs["llama"], "float32", "cpu")
    merge_projections(model)
    mlp = next(m for m in model.modules() if isinstance(m, GatedMLP))
    new = torch.randn_like(mlp.up_proj.weight)
    model.load_state_dict({n: p for n, p in model.state_dict().items()} | {_name(model, mlp.up_proj.weight): new})
    assert torch.equal(mlp.gate_up.weight[mlp.gate_proj.out_features :], new)


def _name(model, param) -> str:
    return next(n for n, p in model.named_parameters() if p is param)
