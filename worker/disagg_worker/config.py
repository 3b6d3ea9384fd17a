"""One frozen configuration chain, built once from the command line.

ServerArgs (what the CLI parses) -> EngineConfig (what the scheduler and model runner need)
-> CacheConfig / SchedulerConfig / DisaggConfig. Derived values are properties. Every CLI flag
maps 1:1 onto a field; environment variables are read only in `disagg_worker.env`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from enum import Enum


class Role(str, Enum):
    MONOLITHIC = "monolithic"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    # Number of KV pages; 0 means "derive from max_total_tokens".
    num_pages: int = 0
    max_total_tokens: int = 16384
    kv_dtype: str = "float32"
    enable_prefix_cache: bool = True

    @property
    def total_pages(self) -> int:
        return self.num_pages or max(1, self.max_total_tokens // self.page_size)

    @property
    def capacity_tokens(self) -> int:
        return self.total_pages * self.page_size


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 64
    # Tokens computed in one forward across all requests (prefill chunks + decode tokens).
    max_batch_tokens: int = 2048
    # Largest prefill chunk of one request; 0 disables chunking.
    chunk_size: int = 512
    enable_overlap: bool = True
    # Pages reserved per running request for its next decode steps before admitting new prefills.
    decode_reserve_tokens: int = 64


@dataclass(frozen=True)
class DisaggConfig:
    role: Role = Role.MONOLITHIC
    transfer_backend: str = "mooncake"  # mooncake | fake
    transfer_protocol: str = "tcp"  # tcp | rdma
    ib_device: str = ""
    bootstrap_port: int = 8998
    # Address other instances use to reach this one (pod IP on Kubernetes).
    advertise_host: str = "127.0.0.1"
    tp_size: int = 1
    pp_size: int = 1
    bootstrap_timeout_s: float = 30.0
    waiting_timeout_s: float = 30.0
    heartbeat_interval_s: float = 2.0
    heartbeat_max_misses: int = 2
    max_bootstrap_queue: int = 256
    # Decode: requests waiting for their handshake and pages beyond this are refused (503).
    max_prealloc_queue: int = 256
    # Mooncake TCP connections per peer (MC_TCP_LANES_PER_PEER; an explicit env var wins). Each
    # lane carries one write at a time with a round trip, so a request's many small writes (one
    # per page run per layer's K and V) finish sooner over more lanes: 64 writes of 4 KiB took
    # 4.0 ms with Mooncake's default of 4 lanes and 2.3 ms with 16 on loopback here.
    tcp_lanes: int = 16


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    served_model_name: str = ""
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    max_context_len: int = 0  # 0: the model's max_position_embeddings
    # "model" runs the real forward; "noop" skips it (scheduler-overhead benchmark only).
    forward: str = "model"
    # Intra-op threads of the scheduler process; 0: half the cores on CPU (the HTTP process and
    # the forward share the machine), torch's default on an accelerator.
    torch_threads: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)

    @property
    def resolved_torch_threads(self) -> int:
        if self.torch_threads > 0:
            return self.torch_threads
        if self.device != "cpu":
            return 0
        import os

        return max(1, (os.cpu_count() or 2) // 2)

    @property
    def uses_prefix_cache(self) -> bool:
        """Decode never matches prompts (they arrive as KV), so its prefix cache is off."""
        return self.cache.enable_prefix_cache and self.disagg.role is not Role.DECODE

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path.rstrip("/").split("/")[-1]


@dataclass(frozen=True)
class ServerArgs:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"
    # Seconds without a scheduler heartbeat after which /health fails.
    health_timeout_s: float = 20.0
    # Generation requests the HTTP front end holds at once (more get 429); 0: `inflight_limit` derives it.
    max_inflight_requests: int = 0
    # On SIGTERM: seconds to finish admitted requests before cutting them short and exiting.
    drain_timeout_s: float = 30.0

    @property
    def inflight_limit(self) -> int:
        """The HTTP bound: what the engine can hold, so a request beyond it would only queue.

        Prefill holds its running batch plus its bootstrap queue, decode its running batch (which
        includes the transfer queue) plus its prealloc queue; a monolithic instance has an unbounded
        waiting queue, so its bound is the running batch plus three batches of backlog.
        """
        if self.max_inflight_requests > 0:
            return self.max_inflight_requests
        running, d = self.engine.scheduler.max_running_requests, self.engine.disagg
        if d.role is Role.PREFILL:
            return running + d.max_bootstrap_queue
        if d.role is Role.DECODE:
            return running + d.max_prealloc_queue
        return 4 * running


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--served-model-name", default="")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-context-len", type=int, default=0)
    p.add_argument("--forward", default="model", choices=["model", "noop"])
    p.add_argument("--torch-threads", type=int, default=0, help="0: half the cores on CPU")
    p.add_argument("--page-size", type=int, default=CacheConfig.page_size)
    p.add_argument("--num-pages", type=int, default=0)
    p.add_argument("--max-total-tokens", type=int, default=CacheConfig.max_total_tokens)
    p.add_argument("--kv-dtype", default="", help="defaults to --dtype")
    p.add_argument("--disable-prefix-cache", action="store_true")
    p.add_argument("--max-running-requests", type=int, default=SchedulerConfig.max_running_requests)
    p.add_argument("--max-batch-tokens", type=int, default=SchedulerConfig.max_batch_tokens)
    p.add_argument("--chunk-size", type=int, default=SchedulerConfig.chunk_size)
    p.add_argument("--disable-overlap", action="store_true")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--health-timeout",
        type=float,
        default=ServerArgs.health_timeout_s,
        help="seconds without a scheduler report after which /health fails",
    )
    p.add_argument(
        "--max-inflight-requests",
        type=int,
        default=ServerArgs.max_inflight_requests,
        help="generation requests held at once, more get 429 (0: what the engine can hold: running requests "
        "plus the prefill bootstrap or decode prealloc queue; 4x --max-running-requests for serve)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=ServerArgs.drain_timeout_s,
        help="on SIGTERM, seconds to finish admitted requests (new ones get 503) before cutting them short",
    )


def add_disagg_args(p: argparse.ArgumentParser) -> None:
    d = DisaggConfig()
    p.add_argument("--transfer-backend", default=d.transfer_backend, choices=["mooncake", "fake"])
    p.add_argument("--transfer-protocol", default=d.transfer_protocol, choices=["tcp", "rdma"])
    p.add_argument("--ib-device", default=d.ib_device)
    p.add_argument("--bootstrap-port", type=int, default=d.bootstrap_port)
    p.add_argument("--advertise-host", default=d.advertise_host)
    p.add_argument("--tp-size", type=int, default=d.tp_size)
    p.add_argument("--pp-size", type=int, default=d.pp_size)
    p.add_argument("--bootstrap-timeout", type=float, default=d.bootstrap_timeout_s)
    p.add_argument("--waiting-timeout", type=float, default=d.waiting_timeout_s)
    p.add_argument("--heartbeat-interval", type=float, default=d.heartbeat_interval_s)
    p.add_argument("--heartbeat-max-misses", type=int, default=d.heartbeat_max_misses)
    p.add_argument(
        "--max-bootstrap-queue",
        type=int,
        default=d.max_bootstrap_queue,
        help="prefill: requests waiting for decode's handshake beyond this are refused (503)",
    )
    p.add_argument(
        "--max-prealloc-queue",
        type=int,
        default=d.max_prealloc_queue,
        help="decode: requests waiting for their handshake and KV pages beyond this are refused (503)",
    )
    p.add_argument(
        "--tcp-lanes",
        type=int,
        default=d.tcp_lanes,
        help="Mooncake TCP connections per peer (MC_TCP_LANES_PER_PEER, which wins if set)",
    )


def server_args_from_cli(ns: argparse.Namespace, role: Role = Role.MONOLITHIC) -> ServerArgs:
    cache = CacheConfig(
        page_size=ns.page_size,
        num_pages=ns.num_pages,
        max_total_tokens=ns.max_total_tokens,
        kv_dtype=ns.kv_dtype or ns.dtype,
        enable_prefix_cache=not ns.disable_prefix_cache,
    )
    sched = SchedulerConfig(
        max_running_requests=ns.max_running_requests,
        max_batch_tokens=ns.max_batch_tokens,
        chunk_size=ns.chunk_size,
        enable_overlap=not ns.disable_overlap,
    )
    disagg = DisaggConfig(role=role)
    if role is not Role.MONOLITHIC:
        disagg = DisaggConfig(
            role=role,
            transfer_backend=ns.transfer_backend,
            transfer_protocol=ns.transfer_protocol,
            ib_device=ns.ib_device,
            bootstrap_port=ns.bootstrap_port,
            advertise_host=ns.advertise_host,
            tp_size=ns.tp_size,
            pp_size=ns.pp_size,
            bootstrap_timeout_s=ns.bootstrap_timeout,
            waiting_timeout_s=ns.waiting_timeout,
            heartbeat_interval_s=ns.heartbeat_interval,
            heartbeat_max_misses=ns.heartbeat_max_misses,
            max_bootstrap_queue=ns.max_bootstrap_queue,
            max_prealloc_queue=ns.max_prealloc_queue,
            tcp_lanes=ns.tcp_lanes,
        )
    engine = EngineConfig(
        model_path=ns.model,
        served_model_name=ns.served_model_name,
        dtype=ns.dtype,
        device=ns.device,
        seed=ns.seed,
        max_context_len=ns.max_context_len,
        forward=ns.forward,
        torch_threads=ns.torch_threads,
        cache=cache,
        scheduler=sched,
        disagg=disagg,
    )
    return ServerArgs(
        engine=engine,
        host=ns.host,
        port=ns.port,
        log_level=ns.log_level,
        health_timeout_s=ns.health_timeout,
        max_inflight_requests=ns.max_inflight_requests,
        drain_timeout_s=ns.drain_timeout,
    )
