"""The command line of the engine commands (`serve`, `prefill`, `decode`): flags in, the frozen
configuration chain of `config.py` out (`server_args_from_cli`), the environment read once."""

from __future__ import annotations

import argparse
from pathlib import Path

from disagg_worker import keys
from disagg_worker.config import (
    QUANTIZATIONS,
    SPECULATIVE_ALGORITHMS,
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
from disagg_worker.model.config import ModelConfig
from disagg_worker.model.parallel import check_parallel


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", required=True, help="Hugging Face model directory, or a GGUF file (or a directory of one)"
    )
    p.add_argument("--served-model-name", default="")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--quantization",
        default="",
        choices=["", *QUANTIZATIONS],
        help="int4: attention and MLP projections as 4-bit weights with a scale and minimum per 32 (llama.cpp's "
        "Q4_1) for torch's CPU int4 kernel; needs --dtype bfloat16. The projections read 0.625 bytes a weight "
        "instead of 2 (concurrency 1 on SmolLM2: 1.36x bfloat16's tok/s in bench/bench_cpu_chat.py); answers are "
        "the bfloat16 engine's up to the weights' rounding",
    )
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
    spec = SpeculativeConfig()
    p.add_argument(
        "--speculative-algorithm",
        default="",
        type=str.upper,
        choices=["", *SPECULATIVE_ALGORITHMS],
        help="speculative decoding: NGRAM drafts from n-gram matches in the request's own tokens (no draft "
        "model); EAGLE from a one-layer draft head fed with the model's hidden states; STANDALONE from a smaller "
        "model with the same tokenizer (both: --speculative-draft-model-path, single-rank instances). Greedy and "
        "seeded answers stay token-identical. Turns overlap scheduling off",
    )
    p.add_argument(
        "--speculative-draft-model-path",
        default="",
        help="EAGLE: the draft head (SGLang's EAGLE checkpoint layout); STANDALONE: the draft model",
    )
    p.add_argument(
        "--speculative-num-steps",
        type=int,
        default=spec.num_steps,
        help="EAGLE/STANDALONE: draft tokens per request and step (one draft forward each)",
    )
    p.add_argument(
        "--speculative-eagle-topk",
        type=int,
        default=spec.eagle_topk,
        help="EAGLE/STANDALONE: drafts per position; 1 (a chain) is what is supported",
    )
    p.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=spec.num_draft_tokens,
        help="NGRAM: draft tokens verified with a request's decode step, at most",
    )
    p.add_argument(
        "--speculative-ngram-min-match-window-size",
        type=int,
        default=spec.min_match,
        help="NGRAM: shortest suffix of the request's tokens that must have occurred before to propose a draft",
    )
    p.add_argument(
        "--speculative-ngram-max-match-window-size",
        type=int,
        default=spec.max_match,
        help="NGRAM: longest suffix matched (the longest one that occurred before proposes the draft)",
    )
    p.add_argument("--tp-size", type=int, default=1, help="tensor parallel ranks (one scheduler process each)")
    p.add_argument("--pp-size", type=int, default=1, help="pipeline parallel stages (one scheduler process each)")
    p.add_argument(
        "--ep-size",
        type=int,
        default=1,
        help="expert parallel ranks for MoE models: 1, or --tp-size (each tensor rank then holds its share of the "
        "routed experts whole, and tokens go to them by all-to-all)",
    )
    p.add_argument(
        "--enable-dp-attention",
        action="store_true",
        help="split the tensor ranks into --dp-size attention groups, each with its own requests and KV "
        "(MLA models: the latent is then cached once per group instead of on every rank); MLP/MoE layers still "
        "run over all --tp-size ranks",
    )
    p.add_argument(
        "--dp-size",
        type=int,
        default=1,
        help="attention groups with --enable-dp-attention (must divide --tp-size); whole-model data parallelism "
        "is more instances",
    )
    p.add_argument(
        "--nnodes",
        type=int,
        default=1,
        help="pods the instance's ranks span (an instance larger than a node; LeaderWorkerSet runs one group)",
    )
    p.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this pod's place among --nnodes: pod 0 serves HTTP and runs rank 0, the others only their ranks",
    )
    p.add_argument("--dist-init-addr", default="", help="HOST:PORT of pod 0, where the ranks meet (--nnodes > 1)")
    p.add_argument(
        "--dist-timeout",
        type=float,
        default=DisaggConfig.dist_timeout_s,
        help="seconds a rank waits for the others in one collective before the instance fails",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--health-timeout",
        type=float,
        default=ServerArgs.health_timeout_s,
        help="seconds without a scheduler report after which /health fails",
    )
    p.add_argument("--api-key", default=None, help="clients must send 'Authorization: Bearer KEY' (/health is open)")
    p.add_argument("--api-key-file", default="", help="a file of API keys, one a line (a mounted Secret)")
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
        help="on SIGTERM, seconds to finish admitted requests (new ones get 503) before cutting them short "
        "(the operator sets the pod's termination grace period from it)",
    )


def add_disagg_args(p: argparse.ArgumentParser) -> None:
    d = DisaggConfig()
    p.add_argument("--transfer-backend", default=d.transfer_backend, choices=["mooncake", "fake"])
    p.add_argument("--transfer-protocol", default=d.transfer_protocol, choices=["tcp", "rdma"])
    p.add_argument("--ib-device", default=d.ib_device)
    p.add_argument("--bootstrap-port", type=int, default=d.bootstrap_port)
    p.add_argument("--advertise-host", default=d.advertise_host)
    p.add_argument("--bootstrap-timeout", type=float, default=d.bootstrap_timeout_s)
    p.add_argument(
        "--waiting-timeout",
        type=float,
        default=d.waiting_timeout_s,
        help="decode: seconds a request's KV may take to arrive once prefill was asked for it (and resolving the "
        "prefill may take); prefill: seconds a request's KV writes may take to land",
    )
    p.add_argument("--heartbeat-interval", type=float, default=d.heartbeat_interval_s)
    p.add_argument(
        "--heartbeat-max-misses",
        type=int,
        default=d.heartbeat_max_misses,
        help="decode: failed checks of a prefill's bootstrap server in a row (no answer, an error, a refused "
        "connection) that fail the requests it serves",
    )
    p.add_argument(
        "--max-bootstrap-queue",
        type=int,
        default=d.max_bootstrap_queue,
        help="prefill: requests waiting for decode's handshake beyond this are refused (503)",
    )
    p.add_argument(
        "--control-port",
        type=int,
        default=d.control_port,
        help="rank i listens for control messages on this port + i (0: any free port)",
    )
    p.add_argument(
        "--transfer-port-base",
        type=int,
        default=d.transfer_port_base,
        help="rank i's Mooncake engine listens in [BASE + i*N, BASE + (i+1)*N - 1], N = --transfer-ports-per-rank "
        "(0: MC_MIN_RPC_PORT..MC_MAX_RPC_PORT)",
    )
    p.add_argument("--transfer-ports-per-rank", type=int, default=d.transfer_ports_per_rank)
    p.add_argument(
        "--quarantine-timeout",
        type=float,
        default=d.quarantine_timeout_s,
        help="decode: longest wait for a silent prefill to confirm a failed room's writes stopped, before its "
        "pages are reused (0: 4x the waiting timeout or heartbeat window)",
    )
    p.add_argument(
        "--max-prealloc-queue",
        type=int,
        default=d.max_prealloc_queue,
        help="decode: requests waiting for their handshake and KV pages beyond this are refused (503)",
    )
    p.add_argument(
        "--decode-prefix-cache",
        action="store_true",
        help="decode: keep finished requests' KV; a request whose prefix decode holds gets only the rest from prefill",
    )
    p.add_argument(
        "--local-prefill",
        action="store_true",
        help="decode: compute the prompts the router marks local_prefill itself (conditional disaggregation)",
    )
    p.add_argument(
        "--auth-token-file",
        default="",
        help="file holding the model's shared secret (bootstrap token, router-to-worker token, target signing)",
    )
    p.add_argument(
        "--tcp-lanes",
        type=int,
        default=d.tcp_lanes,
        help="Mooncake TCP connections per peer (MC_TCP_LANES_PER_PEER, which wins if set)",
    )


def server_args_from_cli(
    ns: argparse.Namespace, role: Role = Role.MONOLITHIC, env: WorkerEnv | None = None
) -> ServerArgs:
    """The config chain of one instance: `ns` from the CLI, `env` (default: `load_env()`) from
    the environment."""
    env = load_env() if env is None else env
    api_keys = keys.read_api_keys(ns.api_key, ns.api_key_file)
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
        speculative=SpeculativeConfig(
            algorithm=ns.speculative_algorithm,
            num_draft_tokens=ns.speculative_num_draft_tokens,
            min_match=ns.speculative_ngram_min_match_window_size,
            max_match=ns.speculative_ngram_max_match_window_size,
            num_steps=ns.speculative_num_steps,
            eagle_topk=ns.speculative_eagle_topk,
            draft_model_path=ns.speculative_draft_model_path,
        ),
    )
    nodes = {
        "nnodes": ns.nnodes,
        "node_rank": ns.node_rank,
        "dist_init_addr": ns.dist_init_addr,
        "dist_timeout_s": ns.dist_timeout,
    }
    sizes = {
        "tp_size": ns.tp_size,
        "pp_size": ns.pp_size,
        "ep_size": ns.ep_size,
        "enable_dp_attention": ns.enable_dp_attention,
        "dp_size": ns.dp_size,
    }
    disagg = DisaggConfig(role=role, **sizes, **nodes)
    if role is not Role.MONOLITHIC:
        disagg = DisaggConfig(
            role=role,
            transfer_backend=ns.transfer_backend,
            transfer_protocol=ns.transfer_protocol,
            ib_device=ns.ib_device,
            bootstrap_port=ns.bootstrap_port,
            advertise_host=ns.advertise_host,
            **sizes,
            **nodes,
            bootstrap_timeout_s=ns.bootstrap_timeout,
            waiting_timeout_s=ns.waiting_timeout,
            heartbeat_interval_s=ns.heartbeat_interval,
            heartbeat_max_misses=ns.heartbeat_max_misses,
            max_bootstrap_queue=ns.max_bootstrap_queue,
            control_port=ns.control_port,
            transfer_port_base=ns.transfer_port_base,
            transfer_ports_per_rank=ns.transfer_ports_per_rank,
            quarantine_timeout_s=ns.quarantine_timeout,
            max_prealloc_queue=ns.max_prealloc_queue,
            decode_prefix_cache=ns.decode_prefix_cache,
            local_prefill=ns.local_prefill,
            tcp_lanes=ns.tcp_lanes,
            auth_token=keys.read_secret(ns.auth_token_file, "--auth-token-file") if ns.auth_token_file else "",
            mc_tcp_lanes_per_peer=env.mc_tcp_lanes_per_peer,
            fault_fail_senders_on_stage=env.fault_fail_senders_on_stage,
            mc_rpc_port_range=env.mc_rpc_port_range,
        )
        disagg.check()
    engine = EngineConfig(
        model_path=ns.model,
        served_model_name=ns.served_model_name,
        dtype=ns.dtype,
        quantization=ns.quantization,
        device=ns.device,
        seed=ns.seed,
        max_context_len=ns.max_context_len,
        forward=ns.forward,
        torch_threads=ns.torch_threads,
        cache=cache,
        scheduler=sched,
        disagg=disagg,
        fault_grammar_pattern=env.fault_grammar_pattern,
    )
    check_model(engine)
    check_exposure(engine.disagg)
    problem = device_problem(engine.disagg, engine.device)
    if problem:
        raise ConfigError(problem)
    return ServerArgs(
        engine=engine,
        host=ns.host,
        port=ns.port,
        log_level=ns.log_level,
        health_timeout_s=ns.health_timeout,
        api_keys=api_keys,
        max_inflight_requests=ns.max_inflight_requests,
        drain_timeout_s=ns.drain_timeout,
    )


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
