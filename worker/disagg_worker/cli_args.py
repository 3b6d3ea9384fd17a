"""The command line of the engine commands (`serve`, `prefill`, `decode`): flags in, the frozen
configuration chain of `config.py` out (`server_args_from_cli`), the environment read once. The flags are
declared in `disagg_api.settings` (`--quantization`'s values in the worker's registry of weight formats,
`model.formats`); `flags` turns them into a parser and fills the chain's fields from them."""

from __future__ import annotations

import argparse
from pathlib import Path

from disagg_api import settings as S
from disagg_api.setting import Setting
from disagg_worker import keys
from disagg_worker.config import (
    CacheConfig,
    ConfigError,
    DisaggConfig,
    EngineConfig,
    Role,
    SchedulerConfig,
    ServerArgs,
    SpeculativeConfig,
)
from disagg_worker.disagg.channel import is_loopback
from disagg_worker.disagg.mooncake.environ import device_problem
from disagg_worker.env import WorkerEnv, load_env
from disagg_worker.flags import add_flags, fill
from disagg_worker.lora_config import LoraConfig
from disagg_worker.model import formats
from disagg_worker.model.config import ModelConfig
from disagg_worker.model.parallel import check_parallel
from disagg_worker.tier_config import TierConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The flags of every engine command: model, KV cache, scheduling, ranks, HTTP front end; `--quantization`
    takes the registered weight formats (`model.formats`)."""
    add_flags(p, S.ENGINE, {S.QUANTIZATION: formats.choices()})


def add_disagg_args(p: argparse.ArgumentParser) -> None:
    """The flags prefill and decode take besides: KV transfer, bootstrap, their queues and ports."""
    add_flags(p, S.DISAGG)


def command_settings(role: Role) -> tuple[Setting, ...]:
    """The settings the command of `role` takes (`disagg serve` for a monolithic instance)."""
    return S.ENGINE if role is Role.MONOLITHIC else S.ENGINE + S.DISAGG


def server_args_from_cli(
    ns: argparse.Namespace, role: Role = Role.MONOLITHIC, env: WorkerEnv | None = None
) -> ServerArgs:
    """The config chain of one instance: `ns` from the CLI, `env` (default: `load_env()`) from
    the environment."""
    env = load_env() if env is None else env
    settings = command_settings(role)
    api_keys = keys.read_api_keys(ns.api_key, ns.api_key_file)
    cache = fill(CacheConfig, ns, settings, kv_dtype=ns.kv_dtype or ns.dtype, tiers=fill(TierConfig, ns, settings))
    sched = fill(SchedulerConfig, ns, settings, speculative=fill(SpeculativeConfig, ns, settings))
    engine = fill(
        EngineConfig,
        ns,
        settings,
        cache=cache,
        scheduler=sched,
        lora=fill(LoraConfig, ns, settings),
        disagg=disagg_config(ns, role, env),
        fault_grammar_pattern=env.fault_grammar_pattern,
    )
    check_model(engine)
    check_tiers(engine)
    check_lora(engine)
    check_exposure(engine.disagg)
    problem = device_problem(engine.disagg, engine.device)
    if problem:
        raise ConfigError(problem)
    return fill(ServerArgs, ns, settings, engine=engine, api_keys=api_keys)


def disagg_config(ns: argparse.Namespace, role: Role, env: WorkerEnv) -> DisaggConfig:
    """The instance's ranks (every role) and, for prefill and decode, its KV transfer, checked."""
    ranks = fill(DisaggConfig, ns, S.ENGINE, role=role)  # checked before the secret's file is read
    if role is Role.MONOLITHIC:
        return ranks
    disagg = fill(
        DisaggConfig,
        ns,
        S.ENGINE + S.DISAGG,
        role=role,
        auth_token=keys.read_secret(ns.auth_token_file, "--auth-token-file") if ns.auth_token_file else "",
        mc_tcp_lanes_per_peer=env.mc_tcp_lanes_per_peer,
        fault_fail_senders_on_stage=env.fault_fail_senders_on_stage,
        fault_stall_after_layer_group=env.fault_stall_after_layer_group,
        fault_stall_decode=env.fault_stall_decode if role is Role.DECODE else "",
        mc_rpc_port_range=env.mc_rpc_port_range,
    )
    disagg.check()
    return disagg


def check_tiers(e: EngineConfig) -> None:
    """The KV tiers sit under the prefix cache of a single-rank instance."""
    if not e.cache.tiers.enabled:
        return
    if not e.cache.enable_prefix_cache:
        raise ConfigError("--enable-hierarchical-cache keeps the prefix cache's pages: drop --disable-prefix-cache")
    if e.world_size > 1:
        d = e.disagg
        raise ConfigError(
            f"--enable-hierarchical-cache runs on single-rank instances (here --tp-size {d.tp_size}, --pp-size "
            f"{d.pp_size}): each rank would copy its own pages, which the ranks' step commands do not carry"
        )


def check_lora(e: EngineConfig) -> None:
    """LoRA adapters on a single-rank instance (monolithic, prefill or decode: P/D carries the adapter,
    docs/lora.md), none named as the base model."""
    if not e.lora.enabled:
        return
    if e.world_size > 1 or e.disagg.dp_size > 1:
        raise ConfigError(
            "--lora-modules runs on single-rank instances for now (--tp-size 1 --pp-size 1 --dp-size 1): the "
            "adapters' weights are not split over ranks yet"
        )
    if e.model_name in dict(e.lora.adapters):
        raise ConfigError(f"--lora-modules {e.model_name}=...: the base model's name, which requests use for it")
    path = Path(e.model_path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"--lora-modules: adapters apply to a Hugging Face model directory, not {path}")
    # Before any process starts: the adapters' files, their ranks and their fit to the model's modules. Imported
    # here, so that a command line without adapters (and the router's, the bootstrap server's) loads no torch.
    from disagg_worker.model.lora_check import check_fit
    from disagg_worker.model.lora_files import LoraError

    try:
        check_fit(path, e.lora.adapters, e.lora.max_lora_rank)
    except LoraError as err:
        raise ConfigError(str(err)) from None


def check_exposure(d: DisaggConfig) -> None:
    """A prefill or decode instance that others can reach must know the model's secret: without it, its KV
    control frames are not authenticated (`keys.control_key`) and its bootstrap server takes anyone's word."""
    if d.role is Role.MONOLITHIC or d.auth_token:
        return
    if not is_loopback(d.advertise_host):  # a host name (even localhost) listens on every interface (`bind_host`)
        raise ConfigError(
            f"--advertise-host {d.advertise_host} is reachable from other hosts: pass the model's secret "
            "(--auth-token-file), without which anyone who reaches this instance could steer its KV transfers"
        )


def check_model(engine: EngineConfig) -> None:
    """A Hugging Face directory whose architecture is not supported, or that cannot be split over the
    instance's ranks, stops the start-up here, naming why (GGUF files are checked when they are loaded)."""
    path = Path(engine.model_path)
    if not (path / "config.json").is_file():
        return
    d = engine.disagg
    try:
        cfg = ModelConfig.from_hf_dir(path)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"--model {path}: {e}") from None
    problem = check_parallel(cfg, d.tp_size, d.pp_size, d.ep_size, d.dp_size)
    if problem:
        raise ConfigError(f"--model {path}: cannot split it over the instance's ranks: {problem}")
