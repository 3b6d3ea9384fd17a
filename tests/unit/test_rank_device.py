"""Which device each rank of a multi-rank instance runs on."""

import pytest

from disagg_worker.config import EngineConfig
from disagg_worker.instance.process import rank_config
from disagg_worker.model.parallel import Shard


def shards(tp: int, pp: int) -> list[Shard]:
    return [Shard(r % tp, tp, r // tp, pp) for r in range(tp * pp)]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (4, 2)])
def test_cuda_gives_every_rank_its_own_gpu(tp, pp):
    cfg = EngineConfig(model_path="m", device="cuda")
    devices = [rank_config(cfg, s).device for s in shards(tp, pp)]
    assert devices == [f"cuda:{i}" for i in range(tp * pp)]
    assert cfg.device == "cuda"  # the instance's own config is left as it was


@pytest.mark.parametrize("device", ["cpu", "cuda:3"])
def test_cpu_and_an_explicit_gpu_are_every_ranks(device):
    cfg = EngineConfig(model_path="m", device=device)
    assert {rank_config(cfg, s).device for s in shards(2, 2)} == {device}
