"""Tensor- and pipeline-parallel shards of the model, in one process: every rank loads only its
slice of the checkpoint, and together they compute the same logits as the whole model.

Tensor ranks run in threads whose all-reduce is a barrier plus a sum (what torch.distributed does
across processes); pipeline stages run one after the other, passing the hidden states.
"""

from __future__ import annotations

import threading

import pytest
import torch

from disagg_worker.mem.kv_pool import KVPool
from disagg_worker.model.config import ModelConfig
from disagg_worker.model.decoder import Collectives
from disagg_worker.model.loader import load_model
from disagg_worker.model.parallel import Shard, check_parallel, shard_slice, stage_layers
from disagg_worker.model.tiny import make_tiny
from tests.unit.model_stubs import PageAllocator, make_batch

PAGE_SIZE = 4
RAW = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 10,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
}
PROMPTS = [[5, 9, 200, 31, 7, 7, 64], [1, 2, 3], [400, 300, 200, 100, 50, 25, 12, 6, 3]]


class ThreadAllReduce:
    """An all-reduce (sum) among `n` threads, one call per thread per reduction."""

    def __init__(self, n: int):
        self.n = n
        self.barrier = threading.Barrier(n)
        self.parts: dict[int, torch.Tensor] = {}
        self.lock = threading.Lock()

    def for_rank(self, rank: int):
        def all_reduce(x: torch.Tensor) -> torch.Tensor:
            with self.lock:
                self.parts[rank] = x.clone()
            self.barrier.wait()
            total = sum(self.parts[r] for r in range(self.n))
            self.barrier.wait()  # everyone read the parts before the next reduction writes them
            x.copy_(total)
            return x

        return all_reduce


@pytest.fixture(scope="module", params=[2, 1], ids=["2-kv-heads", "1-kv-head"])
def model_dir(request, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp(f"tiny-kv{request.param}")
    make_tiny(out, num_kv_heads=request.param)
    return str(out)


def run_stage(model, cfg: ModelConfig, shard: Shard, hidden=None) -> torch.Tensor:
    """Prefill PROMPTS on one rank's shard (its own paged pool) and return its output."""
    pool = KVPool(
        num_layers=len(shard.layer_range(cfg.num_layers)),
        num_pages=64,
        page_size=PAGE_SIZE,
        num_kv_heads=len(shard.kv_heads(cfg)),
        head_dim=cfg.head_dim,
        dtype=torch.float32,
    )
    alloc = PageAllocator(64)
    seqs = [alloc.new_seq(len(p), PAGE_SIZE) for p in PROMPTS]
    return model(make_batch(seqs, PROMPTS, PAGE_SIZE), pool, hidden)


def tensor_parallel_logits(path: str, tp: int, pp_rank: int = 0, pp: int = 1, hidden=None) -> list[torch.Tensor]:
    reduce = ThreadAllReduce(tp)
    outs: list[torch.Tensor | None] = [None] * tp
    errors: list[BaseException] = []

    def rank(t: int) -> None:
        try:
            shard = Shard(t, tp, pp_rank, pp)
            model, cfg = load_model(path, torch.float32, "cpu", shard, Collectives(reduce.for_rank(t)))
            outs[t] = run_stage(model, cfg, shard, hidden)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            reduce.barrier.abort()

    threads = [threading.Thread(target=rank, args=(t,)) for t in range(tp)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return [o for o in outs if o is not None]


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_ranks_compute_the_whole_models_logits(model_dir, tp):
    whole, cfg = load_model(model_dir, torch.float32, "cpu")
    expected = run_stage(whole, cfg, Shard())
    for got in tensor_parallel_logits(model_dir, tp):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tp", [1, 2])
def test_pipeline_stages_compute_the_whole_models_logits(model_dir, tp):
    whole, cfg = load_model(model_dir, torch.float32, "cpu")
    expected = run_stage(whole, cfg, Shard())
    hidden = tensor_parallel_logits(model_dir, tp, pp_rank=0, pp=2)[0]
    assert hidden.shape[-1] == cfg.hidden_size  # stage 0 hands over hidden states, not logits
    for got in tensor_parallel_logits(model_dir, tp, pp_rank=1, pp=2, hidden=hidden):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_a_rank_reads_only_its_slice(model_dir):
    cfg = ModelConfig.from_hf_dir(model_dir)
    shard = Shard(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2)
    model, _ = load_model(model_dir, torch.float32, "cpu", shard)
    names = {n for n, _ in model.named_parameters()}
    layers = stage_layers(cfg.num_layers, 2, 1)
    assert {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")} == set(layers)
    assert "model.embed_tokens.weight" not in names  # untied head: only stage 0 embeds
    q = model.get_parameter(f"model.layers.{layers.start}.self_attn.q_proj.weight")
    assert q.shape == (cfg.num_heads // 2 * cfg.head_dim, cfg.hidden_size)
    k = model.get_parameter(f"model.layers.{layers.start}.self_attn.k_proj.weight")
    assert k.shape == (max(1, cfg.num_kv_heads // 2) * cfg.head_dim, cfg.hidden_size)
    assert shard_slice("model.layers.0.mlp.up_proj.weight", (344, 128), cfg, shard) is None  # stage 0's


def test_kv_heads_replicate_when_fewer_than_ranks():
    cfg = ModelConfig.from_hf_dict(RAW)
    held = [list(Shard(t, 4).kv_heads(cfg)) for t in range(4)]
    assert held == [[0], [0], [1], [1]]
    for t in range(4):  # each rank's query heads use the KV head it holds (8 heads, 4 per KV head)
        assert {h // 4 for h in Shard(t, 4).heads(cfg)} == set(held[t])
    assert check_parallel(cfg, 8, 2) == ""  # 8 heads, each KV head on 4 ranks
    assert "does not divide the 8 attention heads" in check_parallel(cfg, 3, 1)
    assert "exceeds the 2 layers" in check_parallel(cfg, 1, 3)
    odd = ModelConfig.from_hf_dict(
        {**RAW, "hidden_size": 96, "intermediate_size": 96, "num_attention_heads": 12, "num_key_value_heads": 4}
    )
    assert "the 4 KV heads: one must divide the other" in check_parallel(odd, 6, 1)


def test_dp_attention_splits_heads_within_a_group_and_the_mlp_over_every_rank():
    """TP 4 as 2 attention groups of 2: ranks 0-1 and 2-3 each split the 8 heads in two (a group holds every
    head), while the MLP stays sliced four ways; the KV and its transfer see a rank of a 2-rank instance."""
    cfg = ModelConfig.from_hf_dict(RAW)
    shards = [Shard(t, 4, dp_size=2) for t in range(4)]
    assert [(s.dp_rank, s.attn_tp_rank, s.attn_tp_size) for s in shards] == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    assert [list(s.heads(cfg)) for s in shards] == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2
    assert [list(s.kv_heads(cfg)) for s in shards] == [[0], [1]] * 2
    assert shards[3].attention == Shard(1, 2)
    rows = [shard_slice("model.layers.0.mlp.up_proj.weight", (64, 128), cfg, s)[0] for s in shards]
    assert [(r.start, r.stop) for r in rows] == [(0, 16), (16, 32), (32, 48), (48, 64)]  # intermediate_size 64
    assert check_parallel(cfg, 4, 1, dp_size=2) == ""
    assert check_parallel(cfg, 4, 1, dp_size=3) == "dp_size 3 does not divide tp_size 4"
    wide = ModelConfig.from_hf_dict({**RAW, "num_attention_heads": 6, "num_key_value_heads": 6, "hidden_size": 96})
    assert "an attention group's 4 ranks (tp_size / dp_size) does not divide the 6 attention heads" in check_parallel(
        wide, 8, 1, dp_size=2
    )
    with pytest.raises(ValueError, match="dp_size 3 must divide the tp_size 4"):
        Shard(0, 4, dp_size=3)
