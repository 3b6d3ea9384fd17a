"""--mem-fraction-static: the KV pool gets what a fraction of the device's memory leaves once the weights are
held, counted at every buffer's bytes per page; a fraction that cannot work is refused naming the flag."""

from __future__ import annotations

import pytest

from disagg_worker.cli import build_parser, main
from disagg_worker.cli_args import server_args_from_cli
from disagg_worker.config import CacheConfig, ConfigError, EngineConfig, Role, SchedulerConfig
from disagg_worker.engine import pools
from disagg_worker.engine.assemble import load_engine
from disagg_worker.engine.sampling import SamplingParams
from disagg_worker.env import load_env
from disagg_worker.mem.sizing import check_fraction, host_memory, machine_memory, pages_for_fraction, process_resident
from disagg_worker.model.config import ModelConfig
from disagg_worker.model.parallel import Shard
from disagg_worker.model.shapes import SHAPES
from tests.unit.test_engine import run_all

GIB, MIB = 2**30, 2**20


def test_the_pool_gets_the_fraction_less_what_is_held_in_whole_pages():
    assert pages_for_fraction(100 * GIB, 16 * GIB, MIB, 0.9, 1) == (90 * GIB - 16 * GIB) // MIB
    assert pages_for_fraction(1000, 100, 7, 0.5, 1) == (500 - 100) // 7  # rounded down to whole pages
    assert pages_for_fraction(1000, 100, 100, 0.5, 4) == 4  # exactly one request's worth is enough


@pytest.mark.parametrize("fraction", [0.0, 1.0, 1.5, -0.1])
def test_a_fraction_outside_zero_one_is_refused_naming_the_flag(fraction):
    with pytest.raises(ConfigError, match="--mem-fraction-static"):
        pages_for_fraction(100 * GIB, GIB, MIB, fraction, 1)


@pytest.mark.parametrize(("resident", "min_pages"), [(60 * GIB, 1), (49 * GIB, 2 * 1024), (GIB, 50 * 1024)])
def test_less_than_one_requests_worth_of_pages_is_refused_saying_what_to_change(resident, min_pages):
    with pytest.raises(ConfigError, match=r"--mem-fraction-static 0\.5: .* raise --mem-fraction-static or lower"):
        pages_for_fraction(100 * GIB, resident, MIB, 0.5, min_pages)


def test_the_ranks_take_the_fewest_pages_and_refuse_together_when_one_is_short():
    assert pages_for_fraction(1000, 100, 10, 0.5, 5, fewest=lambda pages: min(pages, 7)) == 7
    with pytest.raises(ConfigError, match=r"leaves 3 KV pages on another rank \(here 40\)"):
        pages_for_fraction(1000, 100, 10, 0.5, 5, fewest=lambda pages: min(pages, 3))


def test_the_configuration_refuses_a_bad_fraction_and_one_beside_num_pages():
    assert CacheConfig(mem_fraction_static=0.8).mem_fraction_static == 0.8
    with pytest.raises(ConfigError, match="--mem-fraction-static 1.0"):
        CacheConfig(mem_fraction_static=1.0)
    with pytest.raises(ConfigError, match="--num-pages 64 both"):
        CacheConfig(mem_fraction_static=0.8, num_pages=64)
    check_fraction(0.0, 64)  # off: --num-pages alone decides


def test_the_machines_memory_is_memtotal_or_the_cgroups_lower_limit():
    meminfo = "MemTotal:       16384000 kB\nMemFree:         1000 kB\n"
    assert machine_memory(meminfo) == machine_memory(meminfo, "max\n") == 16384000 * 1024
    assert machine_memory(meminfo, "4294967296\n") == 4 * GIB
    assert machine_memory(meminfo, str(2**62)) == 16384000 * 1024  # cgroup v1's "no limit"
    assert host_memory() > process_resident() > 0  # this machine's, read from /proc


def tiny_config(**overrides) -> ModelConfig:
    return ModelConfig.from_hf_dict({**SHAPES["tiny-llama"], **overrides})


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_a_page_costs_the_bytes_of_every_buffer_of_the_pool(kv_dtype):
    cfg = EngineConfig(model_path="m", cache=CacheConfig(page_size=16, kv_dtype=kv_dtype, num_pages=10))
    model_cfg = tiny_config()
    per_page = pools.pool_page_nbytes(cfg, model_cfg, Shard())
    size = 2 if kv_dtype == "bfloat16" else 4
    assert per_page == 2 * model_cfg.num_layers * 16 * model_cfg.num_kv_heads * model_cfg.head_dim * size
    assert pools.build_kv_pool(cfg, model_cfg, Shard()).nbytes == 10 * per_page


class Fewest:
    """Another rank of the instance holds fewer pages."""

    def min_over_ranks(self, value: int) -> int:
        return min(value, 9)


def fake_machine(monkeypatch, total: int, resident: int) -> None:
    monkeypatch.setattr(pools, "host_memory", lambda: total)
    monkeypatch.setattr(pools, "process_resident", lambda: resident)


def test_every_rank_takes_the_fewest_pages_and_the_fraction_becomes_that_count(monkeypatch):
    fake_machine(monkeypatch, GIB, 100 * MIB)
    cfg = EngineConfig(model_path="m", cache=CacheConfig(page_size=16, mem_fraction_static=0.5))
    sized = pools.size_pool(cfg, tiny_config(max_position_embeddings=64), Shard(), comm=Fewest())
    assert (sized.cache.num_pages, sized.cache.mem_fraction_static, sized.cache.capacity_tokens) == (9, 0.0, 144)
    assert pools.size_pool(EngineConfig(model_path="m"), tiny_config(), Shard()) == EngineConfig(
        model_path="m"
    )  # off: as configured


def test_a_cpu_engine_starts_with_the_pages_its_fraction_leaves_and_serves(monkeypatch, tiny_model):
    fake_machine(monkeypatch, GIB, 100 * MIB)
    cache = CacheConfig(page_size=16, mem_fraction_static=0.25)
    engine = load_engine(
        EngineConfig(model_path=tiny_model, cache=cache, scheduler=SchedulerConfig(enable_overlap=False))
    )
    expected = (GIB // 4 - 100 * MIB) // pools.pool_page_nbytes(engine.cfg, engine.model_cfg, Shard())
    assert engine.cfg.cache.num_pages == engine.kv_pool.num_pages == engine.allocator.num_total == expected
    outs = run_all(
        engine, [([5, 6, 7, 8], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))], overlap=False
    )
    assert sum(len(o.token_ids) for o in outs["0"]) == 4
    engine.close()


def test_a_cpu_engine_refuses_a_fraction_the_weights_fill(monkeypatch, tiny_model):
    fake_machine(monkeypatch, GIB, 600 * MIB)
    cfg = EngineConfig(model_path=tiny_model, cache=CacheConfig(mem_fraction_static=0.5))
    with pytest.raises(ConfigError, match="--mem-fraction-static 0.5: .* leaves 0 KV pages"):
        load_engine(cfg)


def test_the_flag_reaches_the_configuration_and_a_bad_one_stops_the_command(capsys):
    ns = build_parser().parse_args(["serve", "--model", "m", "--mem-fraction-static", "0.85"])
    assert server_args_from_cli(ns, Role.MONOLITHIC, load_env({})).engine.cache.mem_fraction_static == 0.85
    assert main(["serve", "--model", "m", "--mem-fraction-static", "1.5"]) == 2
    assert "--mem-fraction-static 1.5: a fraction of the device's memory" in capsys.readouterr().err
