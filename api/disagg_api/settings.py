"""Every setting of the engine commands, declared once: its flag, type, default and help, and SGLang's flag for it.

`disagg serve` takes `ENGINE`, `disagg prefill|decode` take `ENGINE` and `DISAGG`, in this order in --help. The
worker builds its parser from these tuples and fills its configuration chain from the parsed flags: each field of
the chain names the setting it comes from and takes its default (`disagg_worker.flags`). The operator writes the
workers' command lines with them (`disagg_operator.builders.workers`), and the engine block of its CRD names them
(`disagg_operator.engine_fields`). A new setting is a line here, the config field that names it, its use and its
test (and a CRD field where users set it on a cluster). A setting whose values are members of a registry of the
worker's (`--quantization`: its weight formats, `disagg_worker.model.formats`) lists no choices here: the worker's
parser takes them, and their help, from the registry, which stays the one list of them.

`sglang` records SGLang's flag for the same setting, so that its documentation and recipes translate. Where its
values also mean the same here (`accepts_sglang`) the worker takes that flag too, unlisted in --help; not, for
instance, `--chunked-prefill-size` (-1 turns chunking off there, 0 here) nor `--kv-cache-dtype` (auto, fp8_e4m3...).
"""

from __future__ import annotations

from disagg_api import speculative_settings as _speculative
from disagg_api.setting import Setting
from disagg_api.speculative_settings import SPECULATIVE
from disagg_api.tier_settings import TIERS

DTYPES = ("float32", "bfloat16", "float16")
TRANSFER_BACKENDS = ("mooncake", "fake")
TRANSFER_PROTOCOLS = ("tcp", "rdma")
# Speculative decoding's settings are declared in `speculative_settings`; named here as well, as the operator reads
# them (`settings.SPECULATIVE_ALGORITHM`).
SPECULATIVE_ALGORITHMS = _speculative.SPECULATIVE_ALGORITHMS
SPECULATIVE_ALGORITHM = _speculative.SPECULATIVE_ALGORITHM
SPECULATIVE_DRAFT_MODEL_PATH = _speculative.SPECULATIVE_DRAFT_MODEL_PATH
SPECULATIVE_NUM_STEPS = _speculative.SPECULATIVE_NUM_STEPS
SPECULATIVE_EAGLE_TOPK = _speculative.SPECULATIVE_EAGLE_TOPK
SPECULATIVE_NUM_DRAFT_TOKENS = _speculative.SPECULATIVE_NUM_DRAFT_TOKENS
SPECULATIVE_NGRAM_MIN_MATCH_WINDOW_SIZE = _speculative.SPECULATIVE_NGRAM_MIN_MATCH_WINDOW_SIZE
SPECULATIVE_NGRAM_MAX_MATCH_WINDOW_SIZE = _speculative.SPECULATIVE_NGRAM_MAX_MATCH_WINDOW_SIZE


# The engine: model, weights, KV cache (its tiers: `tier_settings`), scheduling, speculative decoding
# (`speculative_settings`), ranks, HTTP front end.
MODEL = Setting(
    "--model",
    default=None,
    required=True,
    help="Hugging Face model directory, or a GGUF file (or a directory of one)",
    sglang="--model-path",
)
SERVED_MODEL_NAME = Setting("--served-model-name", sglang="--served-model-name")
DTYPE = Setting("--dtype", default="float32", choices=DTYPES, sglang="--dtype")
# Its values are the worker's weight formats, each declared with its help in a file of its own
# (disagg_worker/model/formats/): the worker's --help lists them after this help; the operator names none.
QUANTIZATION = Setting("--quantization", help="how the loaded weights are held", sglang="--quantization")
DEVICE = Setting("--device", default="cpu", sglang="--device")
SEED = Setting("--seed", int, 0, sglang="--random-seed", accepts_sglang=True)
MAX_CONTEXT_LEN = Setting("--max-context-len", int, 0, sglang="--context-length", accepts_sglang=True)
FORWARD = Setting("--forward", default="model", choices=("model", "noop"))
TORCH_THREADS = Setting("--torch-threads", int, 0, help="0: half the cores on CPU")
# LoRA adapters (`docs/lora.md`): vLLM's flags.
LORA_MODULES = Setting(
    "--lora-modules",
    default=(),
    repeated=True,
    help="LoRA adapters in PEFT's format to serve beside the base model, as NAME=PATH (a directory with "
    "adapter_config.json and adapter_model.safetensors); a request selects one by its model field",
    sglang="--lora-paths",
)
MAX_LORAS = Setting(
    "--max-loras", int, 1, help="LoRA adapters resident at once; requests of the others wait for a slot"
)
MAX_LORA_RANK = Setting("--max-lora-rank", int, 16, help="the largest rank r an adapter may have")
PAGE_SIZE = Setting("--page-size", int, 16, sglang="--page-size")
NUM_PAGES = Setting("--num-pages", int, 0)
MAX_TOTAL_TOKENS = Setting("--max-total-tokens", int, 16384, sglang="--max-total-tokens")
MEM_FRACTION_STATIC = Setting(
    "--mem-fraction-static",
    float,
    0.0,
    help="the share of the device's memory (a CPU's: the machine's or its cgroup's, split over the pod's ranks) "
    "for the weights plus the KV pool, whose pages are what is left of it once the weights load; the rest is "
    "for activations. Replaces --max-total-tokens; 0: off (the pool holds --max-total-tokens or --num-pages)",
    sglang="--mem-fraction-static",
)
KV_DTYPE = Setting("--kv-dtype", help="defaults to --dtype", sglang="--kv-cache-dtype")
DISABLE_PREFIX_CACHE = Setting(
    "--disable-prefix-cache", bool, False, sglang="--disable-radix-cache", accepts_sglang=True
)
MAX_RUNNING_REQUESTS = Setting("--max-running-requests", int, 64, sglang="--max-running-requests")
MAX_BATCH_TOKENS = Setting("--max-batch-tokens", int, 2048)
SCHEDULING_POLICY = Setting(
    "--scheduling-policy",
    default="fcfs",
    choices=("fcfs", "priority"),
    help="the order waiting requests are admitted in: by arrival, or by their priority (higher first; vLLM's: lower)",
)
CHUNK_SIZE = Setting("--chunk-size", int, 512, sglang="--chunked-prefill-size")
DISABLE_OVERLAP = Setting("--disable-overlap", bool, False, sglang="--disable-overlap-schedule", accepts_sglang=True)
# Single-rank CUDA instances without a draft model replay their decode steps as CUDA graphs (engine/cuda_graphs.py).
DISABLE_CUDA_GRAPH = Setting(
    "--disable-cuda-graph",
    bool,
    False,
    help="on a CUDA device, run decode steps eagerly instead of replaying the step captured per batch size "
    "(single-rank instances without a draft model capture them)",
    sglang="--disable-cuda-graph",
)
CUDA_GRAPH_MAX_BS = Setting(
    "--cuda-graph-max-bs",
    int,
    64,
    help="the largest decode batch with a CUDA graph (capped by --max-running-requests); larger ones run eagerly",
    sglang="--cuda-graph-max-bs",
)
TP_SIZE = Setting("--tp-size", int, 1, help="tensor parallel ranks (one scheduler process each)", sglang="--tp-size")
PP_SIZE = Setting("--pp-size", int, 1, help="pipeline parallel stages (one scheduler process each)", sglang="--pp-size")
EP_SIZE = Setting(
    "--ep-size",
    int,
    1,
    help="expert parallel ranks for MoE models: 1, or --tp-size (each tensor rank then holds its share of the "
    "routed experts whole, and tokens go to them by all-to-all)",
    sglang="--ep-size",
)
ENABLE_DP_ATTENTION = Setting(
    "--enable-dp-attention",
    bool,
    False,
    help="split the tensor ranks into --dp-size attention groups, each with its own requests and KV "
    "(MLA models: the latent is then cached once per group instead of on every rank); MLP/MoE layers still "
    "run over all --tp-size ranks",
    sglang="--enable-dp-attention",
)
DP_SIZE = Setting(
    "--dp-size",
    int,
    1,
    help="attention groups with --enable-dp-attention (must divide --tp-size); whole-model data parallelism "
    "is more instances",
    sglang="--dp-size",
)
NNODES = Setting(
    "--nnodes",
    int,
    1,
    help="pods the instance's ranks span (an instance larger than a node; LeaderWorkerSet runs one group)",
    sglang="--nnodes",
)
NODE_RANK = Setting(
    "--node-rank",
    int,
    0,
    help="this pod's place among --nnodes: pod 0 serves HTTP and runs rank 0, the others only their ranks",
    sglang="--node-rank",
)
DIST_INIT_ADDR = Setting(
    "--dist-init-addr", help="HOST:PORT of pod 0, where the ranks meet (--nnodes > 1)", sglang="--dist-init-addr"
)
DIST_TIMEOUT = Setting(
    "--dist-timeout",
    float,
    300.0,
    help="seconds a rank waits for the others in one collective before the instance fails",
    sglang="--dist-timeout",
)
HOST = Setting("--host", default="127.0.0.1", sglang="--host")
PORT = Setting("--port", int, 8000, sglang="--port")
LOG_LEVEL = Setting("--log-level", default="info", sglang="--log-level")
HEALTH_TIMEOUT = Setting(
    "--health-timeout", float, 20.0, help="seconds without a scheduler report after which /health fails"
)
API_KEY = Setting(
    "--api-key",
    default=None,
    help="clients must send 'Authorization: Bearer KEY' (/health is open)",
    sglang="--api-key",
)
API_KEY_FILE = Setting("--api-key-file", help="a file of API keys, one a line (a mounted Secret)")
MAX_INFLIGHT_REQUESTS = Setting(
    "--max-inflight-requests",
    int,
    0,
    help="generation requests held at once, more get 429 (0: what the engine can hold: running requests "
    "plus the prefill bootstrap or decode prealloc queue; 4x --max-running-requests for serve)",
)
DRAIN_TIMEOUT = Setting(
    "--drain-timeout",
    float,
    30.0,
    help="on SIGTERM, seconds to finish admitted requests (new ones get 503) before cutting them short "
    "(the operator sets the pod's termination grace period from it)",
)
OTLP_TRACES_ENDPOINT = Setting(
    "--otlp-traces-endpoint",
    help="OpenTelemetry traces of each request (spans of its stages) to this OTLP/HTTP collector: host:port or a "
    "URL (/v1/traces when it has no path), e.g. localhost:4318; empty: tracing off",
    sglang="--otlp-traces-endpoint",
)
OTLP_TRACES_SAMPLING_RATIO = Setting(
    "--otlp-traces-sampling-ratio",
    float,
    1.0,
    help="with --otlp-traces-endpoint, the share of requests sampled; a client's W3C traceparent joins its trace "
    "but never forces sampling (a worker follows the router's decision)",
)

ENGINE = (
    MODEL,
    SERVED_MODEL_NAME,
    DTYPE,
    QUANTIZATION,
    DEVICE,
    SEED,
    MAX_CONTEXT_LEN,
    FORWARD,
    TORCH_THREADS,
    LORA_MODULES,
    MAX_LORAS,
    MAX_LORA_RANK,
    PAGE_SIZE,
    NUM_PAGES,
    MAX_TOTAL_TOKENS,
    MEM_FRACTION_STATIC,
    KV_DTYPE,
    DISABLE_PREFIX_CACHE,
    *TIERS,
    MAX_RUNNING_REQUESTS,
    MAX_BATCH_TOKENS,
    SCHEDULING_POLICY,
    CHUNK_SIZE,
    DISABLE_OVERLAP,
    DISABLE_CUDA_GRAPH,
    CUDA_GRAPH_MAX_BS,
    *SPECULATIVE,
    TP_SIZE,
    PP_SIZE,
    EP_SIZE,
    ENABLE_DP_ATTENTION,
    DP_SIZE,
    NNODES,
    NODE_RANK,
    DIST_INIT_ADDR,
    DIST_TIMEOUT,
    HOST,
    PORT,
    LOG_LEVEL,
    HEALTH_TIMEOUT,
    API_KEY,
    API_KEY_FILE,
    MAX_INFLIGHT_REQUESTS,
    DRAIN_TIMEOUT,
    OTLP_TRACES_ENDPOINT,
    OTLP_TRACES_SAMPLING_RATIO,
)

# Prefill and decode: the KV transfer, the bootstrap handshake, their queues and listening ports, the shared secret.
TRANSFER_BACKEND = Setting(
    "--transfer-backend",
    default="mooncake",
    choices=TRANSFER_BACKENDS,
    sglang="--disaggregation-transfer-backend",
    accepts_sglang=True,
)
TRANSFER_PROTOCOL = Setting("--transfer-protocol", default="tcp", choices=TRANSFER_PROTOCOLS)
IB_DEVICE = Setting("--ib-device", sglang="--disaggregation-ib-device", accepts_sglang=True)
BOOTSTRAP_PORT = Setting(
    "--bootstrap-port",
    int,
    8998,
    help="prefill: the port of its bootstrap server; decode: that of the prefills a gateway names "
    "(x-prefiller-host-port), as the router's --bootstrap-port",
    sglang="--disaggregation-bootstrap-port",
    accepts_sglang=True,
)
ADVERTISE_HOST = Setting("--advertise-host", default="127.0.0.1")
BOOTSTRAP_TIMEOUT = Setting("--bootstrap-timeout", float, 30.0)
WAITING_TIMEOUT = Setting(
    "--waiting-timeout",
    float,
    30.0,
    help="decode: seconds a request's KV may take to arrive once prefill was asked for it (and resolving the "
    "prefill may take); prefill: seconds a request's KV writes may take to land",
)
HEARTBEAT_INTERVAL = Setting("--heartbeat-interval", float, 2.0)
HEARTBEAT_MAX_MISSES = Setting(
    "--heartbeat-max-misses",
    int,
    2,
    help="decode: failed checks of a prefill's bootstrap server in a row (no answer, an error, a refused "
    "connection) that fail the requests it serves",
)
MAX_BOOTSTRAP_QUEUE = Setting(
    "--max-bootstrap-queue",
    int,
    256,
    help="prefill: requests waiting for decode's handshake beyond this are refused (503)",
)
CONTROL_PORT = Setting(
    "--control-port", int, 0, help="rank i listens for control messages on this port + i (0: any free port)"
)
TRANSFER_PORT_BASE = Setting(
    "--transfer-port-base",
    int,
    0,
    help="rank i's Mooncake engine listens in [BASE + i*N, BASE + (i+1)*N - 1], N = --transfer-ports-per-rank "
    "(0: MC_MIN_RPC_PORT..MC_MAX_RPC_PORT)",
)
TRANSFER_PORTS_PER_RANK = Setting("--transfer-ports-per-rank", int, 8)
QUARANTINE_TIMEOUT = Setting(
    "--quarantine-timeout",
    float,
    0.0,
    help="decode: longest wait for a silent prefill to confirm a failed room's writes stopped, before its "
    "pages are reused (0: 4x the waiting timeout or heartbeat window)",
)
MAX_PREALLOC_QUEUE = Setting(
    "--max-prealloc-queue",
    int,
    256,
    help="decode: requests waiting for their handshake and KV pages beyond this are refused (503)",
)
DECODE_PREFIX_CACHE = Setting(
    "--decode-prefix-cache",
    bool,
    False,
    help="decode: keep finished requests' KV; a request whose prefix decode holds gets only the rest from prefill",
    sglang="--disaggregation-decode-enable-radix-cache",
    accepts_sglang=True,
)
LOCAL_PREFILL = Setting(
    "--local-prefill",
    bool,
    False,
    help="decode: compute the prompts the router marks local_prefill itself (conditional disaggregation)",
)
PREFILL_ALLOW = Setting(
    "--prefill-allow",
    help="decode: the prefill instances a request's x-prefiller-host-port header (a gateway's choice of prefill) "
    "may name, comma-separated: CIDRs (10.0.0.0/8), host names (the prefills' headless Service: the name and "
    "the addresses it resolves to), or * for any host; empty: loopback only. A header naming another host is "
    "refused (400): this instance sends the prompt and its worker token there",
)
AUTH_TOKEN_FILE = Setting(
    "--auth-token-file",
    help="file holding the model's shared secret (bootstrap token, router-to-worker token, target signing)",
)
TCP_LANES = Setting(
    "--tcp-lanes", int, 16, help="Mooncake TCP connections per peer (MC_TCP_LANES_PER_PEER, which wins if set)"
)
DISABLE_LAYER_PIPELINE = Setting(
    "--disable-disagg-layer-pipeline",
    bool,
    False,
    help="prefill: send a chunk's KV pages after the whole chunk, instead of each layer group's as soon as the "
    "forward computed it while the next layers run (on for prompts of at least "
    "--disagg-layer-pipeline-min-prefill-len tokens; SGLang's --enable-disagg-layer-pipeline is accepted)",
    sglang="--enable-disagg-layer-pipeline",
    accepts_sglang=True,
    sglang_negates=True,
)
LAYER_GROUP_SIZE = Setting(
    "--disagg-layer-group-size",
    int,
    4,
    help="prefill, layer pipeline: layers whose KV moves together (one write per page run and buffer of each); "
    "the last group's layers move one by one (nothing computes after them to hide their transfer)",
    sglang="--disagg-layer-group-size",
)
LAYER_PIPELINE_MIN_PREFILL_LEN = Setting(
    "--disagg-layer-pipeline-min-prefill-len",
    int,
    2048,
    help="prefill, layer pipeline: shorter prompts move whole after each chunk (their transfer is short)",
    sglang="--disagg-layer-pipeline-min-prefill-len",
)

DISAGG = (
    TRANSFER_BACKEND,
    TRANSFER_PROTOCOL,
    IB_DEVICE,
    BOOTSTRAP_PORT,
    ADVERTISE_HOST,
    BOOTSTRAP_TIMEOUT,
    WAITING_TIMEOUT,
    HEARTBEAT_INTERVAL,
    HEARTBEAT_MAX_MISSES,
    MAX_BOOTSTRAP_QUEUE,
    CONTROL_PORT,
    TRANSFER_PORT_BASE,
    TRANSFER_PORTS_PER_RANK,
    QUARANTINE_TIMEOUT,
    MAX_PREALLOC_QUEUE,
    DECODE_PREFIX_CACHE,
    LOCAL_PREFILL,
    PREFILL_ALLOW,
    AUTH_TOKEN_FILE,
    TCP_LANES,
    DISABLE_LAYER_PIPELINE,
    LAYER_GROUP_SIZE,
    LAYER_PIPELINE_MIN_PREFILL_LEN,
)
