"""One frozen configuration chain, built once from the command line.

ServerArgs (what the CLI parses) -> EngineConfig (what the scheduler and model runner need)
-> CacheConfig / SchedulerConfig / DisaggConfig. Derived values are properties. A field a flag fills
names its setting (`from_flag`: `disagg_api.settings` declares each flag, its type, default and help once)
and takes its default; environment variables are read only in `disagg_worker.env`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum

from disagg_api import settings as S
from disagg_worker import keys
from disagg_worker.cache_config import CacheConfig as CacheConfig
from disagg_worker.errors import ConfigError as ConfigError
from disagg_worker.flags import from_flag
from disagg_worker.lora_config import LoraConfig
from disagg_worker.model.formats import weight_format
from disagg_worker.model.source import served_name
from disagg_worker.speculative_config import DRAFT_MODEL_ALGORITHMS as DRAFT_MODEL_ALGORITHMS
from disagg_worker.speculative_config import SpeculativeConfig as SpeculativeConfig


class Role(str, Enum):
    MONOLITHIC = "monolithic"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = from_flag(S.MAX_RUNNING_REQUESTS)
    max_batch_tokens: int = from_flag(S.MAX_BATCH_TOKENS)  # in one forward: prefill chunks + decode tokens
    chunk_size: int = from_flag(S.CHUNK_SIZE)  # largest prefill chunk of one request; 0 disables chunking
    scheduling_policy: str = from_flag(S.SCHEDULING_POLICY)  # the waiting queue's order (`engine/waiting.py`)
    enable_overlap: bool = from_flag(S.DISABLE_OVERLAP, negated=True)
    cuda_graph: bool = from_flag(S.DISABLE_CUDA_GRAPH, negated=True)  # decode steps replayed (`engine.cuda_graphs`)
    cuda_graph_max_bs: int = from_flag(S.CUDA_GRAPH_MAX_BS)
    # Pages reserved per running request for its next decode steps before admitting new prefills.
    decode_reserve_tokens: int = 64
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        spec = self.speculative
        if spec.enabled and spec.max_draft >= self.max_batch_tokens:
            flag = "--speculative-num-steps" if spec.uses_draft_model else "--speculative-num-draft-tokens"
            raise ConfigError(f"{flag} {spec.max_draft} leaves no room in --max-batch-tokens {self.max_batch_tokens}")


@dataclass(frozen=True)
class DisaggConfig:
    role: Role = Role.MONOLITHIC
    transfer_backend: str = from_flag(S.TRANSFER_BACKEND)  # mooncake | fake
    transfer_protocol: str = from_flag(S.TRANSFER_PROTOCOL)  # tcp | rdma
    ib_device: str = from_flag(S.IB_DEVICE)
    bootstrap_port: int = from_flag(S.BOOTSTRAP_PORT)
    # Address other instances use to reach this one (pod IP on Kubernetes).
    advertise_host: str = from_flag(S.ADVERTISE_HOST)
    # Ranks of the instance (every role, monolithic too): tensor ranks per stage, pipeline stages.
    tp_size: int = from_flag(S.TP_SIZE)
    pp_size: int = from_flag(S.PP_SIZE)
    # Expert parallelism: 1, or tp_size (the stage's tensor ranks share out the routed experts).
    ep_size: int = from_flag(S.EP_SIZE)
    # DP attention: the tensor ranks split into `dp_size` attention groups of tp_size / dp_size ranks, each
    # with its own scheduler, requests and KV pool; the MLP/MoE layers run over all tp_size ranks on every
    # group's tokens, gathered before and split after. Whole-replica data parallelism is more instances.
    enable_dp_attention: bool = from_flag(S.ENABLE_DP_ATTENTION)
    dp_size: int = from_flag(S.DP_SIZE)
    # An instance across pods (larger than one node): `nnodes` pods run `num_ranks // nnodes` consecutive ranks
    # each, pod `node_rank` those from `node_rank * ranks_per_node`. Pod 0 runs rank 0 (the driver), the HTTP
    # front end and, on prefill, the bootstrap server; the ranks meet at `dist_init_addr`, pod 0's host:port.
    nnodes: int = from_flag(S.NNODES)
    node_rank: int = from_flag(S.NODE_RANK)
    dist_init_addr: str = from_flag(S.DIST_INIT_ADDR)
    # The longest a rank waits for the others in one collective (an all-reduce of a forward, the driver's next
    # step) before it fails the instance. Idle ranks exchange an empty step every second (`LOOP`), so only a
    # hung or unreachable rank makes another wait that long.
    dist_timeout_s: float = from_flag(S.DIST_TIMEOUT)
    bootstrap_timeout_s: float = from_flag(S.BOOTSTRAP_TIMEOUT)
    waiting_timeout_s: float = from_flag(S.WAITING_TIMEOUT)
    heartbeat_interval_s: float = from_flag(S.HEARTBEAT_INTERVAL)
    heartbeat_max_misses: int = from_flag(S.HEARTBEAT_MAX_MISSES)
    max_bootstrap_queue: int = from_flag(S.MAX_BOOTSTRAP_QUEUE)
    # Listening ports (each must sit where the operator's NetworkPolicy opens it). Rank i of an instance
    # (i = pp_rank * tp_size + tp_rank) listens for control messages on control_port + i (0: any free port, for
    # local runs), and its Mooncake engine takes its two ports (RPC and TCP data) from the window
    # transfer_port_base + i * transfer_ports_per_rank onwards (0: Mooncake's own range, MC_MIN_RPC_PORT..
    # MC_MAX_RPC_PORT, 15000-17000 unless set). A window holds more than two ports because a killed engine's
    # ports stay in TIME_WAIT for ~60 s and Mooncake cannot bind them again: a restarted rank takes two others.
    control_port: int = from_flag(S.CONTROL_PORT)
    transfer_port_base: int = from_flag(S.TRANSFER_PORT_BASE)
    transfer_ports_per_rank: int = from_flag(S.TRANSFER_PORTS_PER_RANK)
    # Decode: pages of a failed room stay out of the free list while prefill may still write them (quarantine),
    # but not longer than this: a prefill that stays silent is then declared dead and the pages come back.
    # 0: four times the longest of the waiting timeout and the heartbeat window.
    quarantine_timeout_s: float = from_flag(S.QUARANTINE_TIMEOUT)
    max_prealloc_queue: int = from_flag(S.MAX_PREALLOC_QUEUE)
    # Decode: keep finished requests' KV in a prefix cache, so that a request whose prefix decode holds receives
    # only the pages it lacks from prefill (off by default: without a router sending follow-ups back to the same
    # decode, its cache only takes pages from the running requests).
    decode_prefix_cache: bool = from_flag(S.DECODE_PREFIX_CACHE)
    # Decode: compute prompts the router marks `local_prefill` itself (too little lacking to be worth a transfer).
    local_prefill: bool = from_flag(S.LOCAL_PREFILL)
    # Decode: the prefills a gateway's `x-prefiller-host-port` may name (`router/prefiller.py`; "": loopback only).
    prefill_allow: str = from_flag(S.PREFILL_ALLOW)
    # Mooncake TCP connections per peer (MC_TCP_LANES_PER_PEER wins if set). A lane carries one write at a time, so a
    # request's many small writes finish sooner over more: 64 of 4 KiB took 4.0 ms over 4 lanes (default), 2.3 over 16.
    tcp_lanes: int = from_flag(S.TCP_LANES)
    layer_pipeline: bool = from_flag(S.DISABLE_LAYER_PIPELINE, negated=True)  # prefill: KV by layer group (`layerwise`)
    layer_group_size: int = from_flag(S.LAYER_GROUP_SIZE)
    layer_pipeline_min_prefill_len: int = from_flag(S.LAYER_PIPELINE_MIN_PREFILL_LEN)
    # The model's shared secret, read from --auth-token-file at start-up ("": no authentication, local runs only),
    # kept out of repr so that it is never logged. Each use has its own key derived from it (`keys`): the
    # bootstrap server's bearer token, the router's token to worker HTTP ports, the key signing bootstrap targets.
    auth_token: str = field(default="", repr=False)
    # From the environment at start-up (`disagg_worker.env`): MC_TCP_LANES_PER_PEER as set (None: not); it wins.
    mc_tcp_lanes_per_peer: str | None = None
    # Tests only (`env`): prefill ranks of this pipeline stage fail every new sender locally (-1: off); a streamed
    # forward stalls after layer group N while the file PATH does not exist ((N, PATH); (-1, ""): off); a decode's
    # scheduler loop takes no step while the file `fault_stall_decode` exists ("": off).
    fault_fail_senders_on_stage: int = -1
    fault_stall_after_layer_group: tuple[int, str] = (-1, "")
    fault_stall_decode: str = ""
    # MC_MIN_RPC_PORT / MC_MAX_RPC_PORT as the user set them (None: not set); not with transfer_port_base.
    mc_rpc_port_range: tuple[str | None, str | None] = (None, None)

    @property
    def num_ranks(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def attn_tp_size(self) -> int:
        """Tensor ranks of one attention group (all tp_size ranks without DP attention)."""
        return self.tp_size // self.dp_size

    @property
    def ranks_per_node(self) -> int:
        return self.num_ranks // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The world ranks this pod runs."""
        return range(self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node)

    @property
    def leader_host(self) -> str:
        """How this pod reaches pod 0 (its bootstrap server, its ranks' meeting point)."""
        if self.node_rank == 0 or not self.dist_init_addr:
            return "127.0.0.1"
        return self.dist_init_addr.rsplit(":", 1)[0].strip("[]")

    def rank_index(self, tp_rank: int, pp_rank: int, dp_rank: int = 0) -> int:
        """The position of a rank in its instance: what its ports are offset by (`tp_rank` within its
        attention group `dp_rank` under DP attention)."""
        return pp_rank * self.tp_size + dp_rank * self.attn_tp_size + tp_rank

    def control_port_of(self, rank: int) -> int:
        """The control channel port of rank `rank` (0: any free port)."""
        return self.control_port + rank if self.control_port else 0

    def transfer_ports_of(self, rank: int) -> tuple[int, int] | None:
        """The first and last port of rank `rank`'s Mooncake window (None: Mooncake's own range)."""
        if not self.transfer_port_base:
            return None
        first = self.transfer_port_base + rank * self.transfer_ports_per_rank
        return first, first + self.transfer_ports_per_rank - 1

    @property
    def quarantine_limit_s(self) -> float:
        """How long pages may stay quarantined before their prefill instance is declared dead."""
        if self.quarantine_timeout_s > 0:
            return self.quarantine_timeout_s
        return 4 * max(self.waiting_timeout_s, self.heartbeat_interval_s * self.heartbeat_max_misses)

    @property
    def bootstrap_token(self) -> str:
        """Bearer token of the bootstrap server ("" without a shared secret)."""
        return keys.derive(self.auth_token, keys.BOOTSTRAP) if self.auth_token else ""

    @property
    def worker_token(self) -> str:
        """Bearer token the router presents to this instance's HTTP port ("" without a shared secret)."""
        return keys.derive(self.auth_token, keys.WORKER) if self.auth_token else ""

    @property
    def target_key(self) -> str:
        """Key of the router's signature over a request's bootstrap target ("": targets are not checked)."""
        return keys.derive(self.auth_token, keys.TARGET) if self.auth_token else ""

    @property
    def kv_names(self) -> tuple[bytes, str]:
        """The key of the cached pages' names and its id (`keys.kv_names`; unkeyed without a shared secret)."""
        return keys.kv_names(self.auth_token)

    @property
    def store_tag_key(self) -> bytes:
        """The key of the tags on pages in Mooncake Store (`keys.store_tag_key`; a fixed one without a secret)."""
        return keys.store_tag_key(self.auth_token)

    def __post_init__(self) -> None:
        if self.nnodes < 1 or self.num_ranks % self.nnodes:
            raise ConfigError(
                f"--nnodes {self.nnodes} must divide the instance's {self.num_ranks} rank(s) (--tp-size x --pp-size)"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank}: from 0 to --nnodes {self.nnodes} - 1")
        if self.nnodes > 1:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(
                    f"--dist-init-addr {self.dist_init_addr!r}: HOST:PORT of pod 0, where the instance's ranks "
                    "meet (needed with --nnodes above 1)"
                )
        if self.dist_timeout_s < 30.0:
            raise ConfigError(
                f"--dist-timeout {self.dist_timeout_s}: at least 30 s (ranks also wait for each other to load "
                "the model within it)"
            )
        if self.ep_size not in (1, self.tp_size):
            raise ConfigError(
                f"--ep-size {self.ep_size} must be 1 or equal --tp-size {self.tp_size}: the experts are shared out "
                "among an instance's tensor ranks"
            )
        self._check_dp()

    def _check_dp(self) -> None:
        if self.dp_size < 1:
            raise ConfigError(f"--dp-size {self.dp_size}: at least 1")
        if self.dp_size > 1 and not self.enable_dp_attention:
            raise ConfigError(
                f"--dp-size {self.dp_size} without --enable-dp-attention: --dp-size splits an instance's attention "
                "into groups (with --enable-dp-attention); whole-model data parallelism is more instances "
                "(replicas), which the router spreads requests over"
            )
        if not self.enable_dp_attention:
            return
        if self.tp_size % self.dp_size:
            raise ConfigError(
                f"--dp-size {self.dp_size} must divide --tp-size {self.tp_size}: each attention group takes "
                "tp-size / dp-size of the tensor ranks"
            )
        if self.pp_size > 1 or self.nnodes > 1:
            raise ConfigError(
                f"--enable-dp-attention runs on one pipeline stage in one pod (here --pp-size {self.pp_size}, "
                f"--nnodes {self.nnodes})"
            )

    def check(self) -> None:
        """Raise ConfigError naming the first setting that cannot work."""
        spans = [
            ("--control-port", self.control_port, self.num_ranks),
            ("--transfer-port-base", self.transfer_port_base, self.num_ranks * self.transfer_ports_per_rank),
        ]
        for flag, base, count in spans:
            if base and not (1024 <= base and base + count - 1 <= 65535):
                raise ConfigError(
                    f"{flag} {base}: the {count} port(s) of {self.num_ranks} rank(s) must fit in 1024-65535"
                )
        if self.transfer_ports_per_rank < 2:
            raise ConfigError("--transfer-ports-per-rank must be at least 2 (Mooncake listens on two ports)")
        if self.transfer_port_base and self.mc_rpc_port_range != (None, None):
            raise ConfigError(
                "MC_MIN_RPC_PORT/MC_MAX_RPC_PORT are set and so is --transfer-port-base, which sets them per "
                "rank: keep one of the two"
            )
        for flag, on in (("--decode-prefix-cache", self.decode_prefix_cache), ("--local-prefill", self.local_prefill)):
            if on and self.role is not Role.DECODE:
                raise ConfigError(f"{flag} is a decode instance's option")


@dataclass(frozen=True)
class EngineConfig:
    model_path: str = from_flag(S.MODEL)
    served_model_name: str = from_flag(S.SERVED_MODEL_NAME)
    dtype: str = from_flag(S.DTYPE)
    # How the loaded weights are held: a name of the weight formats' registry (`model/formats/`): "": the weights
    # in `dtype`; "int4": weight-only 4-bit projections (bfloat16 on a CPU).
    quantization: str = from_flag(S.QUANTIZATION)
    device: str = from_flag(S.DEVICE)
    seed: int = from_flag(S.SEED)
    max_context_len: int = from_flag(S.MAX_CONTEXT_LEN)  # 0: the model's max_position_embeddings
    # "model" runs the real forward; "noop" skips it (scheduler-overhead benchmark only).
    forward: str = from_flag(S.FORWARD)
    # Intra-op threads of each scheduler process; 0: half the cores on CPU (the HTTP process and
    # the forward share the machine) split over the ranks, torch's default on an accelerator.
    torch_threads: int = from_flag(S.TORCH_THREADS)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)  # adapters served beside the base model
    fault_grammar_pattern: str = ""  # tests only: compiling this regex raises an unexpected exception (`env`)

    def __post_init__(self) -> None:
        weight_format(self.quantization).check(self)
        spec = self.scheduler.speculative
        if spec.uses_draft_model and self.world_size > 1:
            raise ConfigError(
                f"--speculative-algorithm {spec.algorithm} runs on single-rank instances only (--tp-size 1 "
                f"--pp-size 1, here {self.disagg.tp_size} and {self.disagg.pp_size}): the draft model runs beside the "
                "first rank; NGRAM works with any ranks"
            )
        if spec.uses_draft_model and spec.num_steps + 1 > self.cache.page_size:
            raise ConfigError(
                f"--speculative-num-steps {spec.num_steps}: a step's tokens (the drafts and the last known one) "
                f"must fit in one page of --page-size {self.cache.page_size}"
            )

    @property
    def resolved_torch_threads(self) -> int:
        if self.torch_threads > 0:
            return self.torch_threads
        if self.device != "cpu":
            return 0
        return max(1, (os.cpu_count() or 2) // 2 // self.world_size)

    @property
    def drafts(self) -> bool:
        """Speculative drafts are made here: speculation is on and the role decodes (prefill samples one token)."""
        return self.scheduler.speculative.enabled and self.disagg.role is not Role.PREFILL

    @property
    def overlap(self) -> bool:
        """Overlap scheduling, unless this instance drafts: a request's next draft depends on how many tokens of
        its last one were accepted, which is known only once that step is processed. (Overlapping the steps of
        requests pausing from drafting was tried: on 2 cores at concurrency 1 it made NGRAM 17% slower, the
        hand-off to the forward thread costing more than it hid.)"""
        return self.scheduler.enable_overlap and not self.drafts

    @property
    def world_size(self) -> int:
        """Scheduler processes of the instance: one per tensor rank per pipeline stage."""
        return self.disagg.tp_size * self.disagg.pp_size

    @property
    def uses_prefix_cache(self) -> bool:
        """Decode's prefix cache is off unless asked for (`DisaggConfig.decode_prefix_cache`, or the KV tiers)."""
        decode = self.disagg.decode_prefix_cache or self.cache.tiers.enabled
        return self.cache.enable_prefix_cache and (self.disagg.role is not Role.DECODE or decode)

    @property
    def takes_local_prefill(self) -> bool:
        """Requests marked `local_prefill` are computed here: always on a monolithic instance, on decode when
        asked for (`DisaggConfig.local_prefill`), never on prefill."""
        d = self.disagg
        return d.role is Role.MONOLITHIC or (d.role is Role.DECODE and d.local_prefill)

    @property
    def model_name(self) -> str:
        return self.served_model_name or served_name(self.model_path)


@dataclass(frozen=True)
class ServerArgs:
    engine: EngineConfig
    host: str = from_flag(S.HOST)
    port: int = from_flag(S.PORT)
    log_level: str = from_flag(S.LOG_LEVEL)
    health_timeout_s: float = from_flag(S.HEALTH_TIMEOUT)
    # Bearer tokens clients must present (--api-key, --api-key-file; empty: no API keys). /health
    # stays open. Kept out of repr so that they are never logged.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # Generation requests the HTTP front end holds at once (more get 429); 0: `inflight_limit` derives it.
    max_inflight_requests: int = from_flag(S.MAX_INFLIGHT_REQUESTS)
    drain_timeout_s: float = from_flag(S.DRAIN_TIMEOUT)
    # OpenTelemetry traces (`disagg_worker.tracing`): the OTLP/HTTP collector ("": off) and the sampled share.
    otlp_traces_endpoint: str = from_flag(S.OTLP_TRACES_ENDPOINT)
    otlp_traces_sampling_ratio: float = from_flag(S.OTLP_TRACES_SAMPLING_RATIO)

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
        queue = {Role.PREFILL: d.max_bootstrap_queue, Role.DECODE: d.max_prealloc_queue}.get(d.role)
        return running + queue if queue is not None else 4 * running
