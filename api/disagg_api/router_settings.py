"""Every setting of `disagg router`, declared once (as `settings` declares the engine's).

The router makes its parser from `ROUTER` (`disagg_worker.router.args`; its static worker lists, `--prefill URL
PORT` and `--decode URL`, are the two flags spelled there); the operator writes the router's command line with
these (`disagg_operator.builders.router`) and its CRD's policy enum from `POLICIES`. Flags the engine commands
take with the same meaning (`--host`, `--port`, `--log-level`, the API keys) are the engine's own settings.
"""

from __future__ import annotations

from disagg_api import settings as engine
from disagg_api.setting import Setting

POLICIES = ("round_robin", "least_load", "cache_aware")
GROUP_POLICIES = ("load", "room")

SERVED_MODEL_NAME = Setting("--served-model-name", default="default")
PREFILL_DNS = Setting("--prefill-dns", help="HOST:PORT of a headless Service of prefill pods")
DECODE_DNS = Setting("--decode-dns", help="HOST:PORT of a headless Service of decode pods")
BOOTSTRAP_PORT = Setting("--bootstrap-port", int, 8998)
POLICY = Setting(
    "--policy",
    default="round_robin",
    choices=POLICIES,
    help="cache_aware: prefill by the prompt tokens a worker has not cached plus this router's prefill tokens "
    "running there (the workers' GET /kv_events), decode by least load; needs --tokenizer",
)
TOKENIZER = Setting("--tokenizer", help="the model (directory or GGUF) whose tokenizer cache_aware uses")
CACHE_AWARE_BALANCE_TOKENS = Setting(
    "--cache-aware-balance-tokens",
    int,
    4096,
    help="cache_aware: while a prefill worker is idle, one with this many prompt tokens pending takes no more",
)
DECODE_ONLY_TOKENS = Setting(
    "--decode-only-tokens",
    int,
    0,
    help="cache_aware: a decode lacking at most this many of a prompt's tokens computes them itself, with no "
    "prefill (conditional disaggregation; decode runs with --local-prefill); 0: off",
)
DP_GROUP_POLICY = Setting(
    "--dp-group-policy",
    default="load",
    choices=GROUP_POLICIES,
    help="workers with DP attention: pick a request's attention group by load (the fewest of this router's "
    "requests open on it, then the worker's reported load; under --policy cache_aware a prefill's group by "
    "its cache first) or by bootstrap_room %% dp_size",
)
RETRIES = Setting("--retries", int, 2)
MIGRATION_LIMIT = Setting(
    "--migration-limit",
    int,
    3,
    help="times a streamed choice whose decode fails goes on on another pair, from its last token (the client's "
    "stream continues); 0: such a stream ends with an error event",
)
STREAM_STALL_TIMEOUT = Setting(
    "--stream-stall-timeout",
    float,
    60.0,
    help="seconds a decode stream may send nothing before the router counts its decode as failed (and migrates "
    "the stream); 0: only --request-timeout ends it",
)
CLIENT_WRITE_TIMEOUT = Setting(
    "--client-write-timeout",
    float,
    30.0,
    help="seconds a write of a stream to its client may wait for the client to take bytes; a client that stops "
    "reading for longer is disconnected and every choice of its request aborted on its decode (their pages "
    "freed); 0: only --request-timeout ends such a stream",
)
STALL_HOLD = Setting(
    "--stall-hold",
    float,
    60.0,
    help="seconds a decode that sent nothing on any of its streams while one of them stalled (--stream-stall-"
    "timeout) stays out of rotation, whatever its /health says: the stalled streams migrate elsewhere and new "
    "requests avoid it; afterwards it is picked again",
)
RESPONSES_STORE_SIZE = Setting(
    "--responses-store-size",
    int,
    1000,
    help="Responses API answers kept for previous_response_id and GET /v1/responses/{id} (the oldest go first; "
    "0 keeps none); each router replica keeps its own",
)
RESPONSES_STORE_BYTES = Setting(
    "--responses-store-bytes",
    int,
    64 * 1024 * 1024,
    help="bytes of Responses API answers and their conversations kept, as JSON (the oldest go first; one answer "
    "alone larger is not kept)",
)
RESPONSES_STORE_TTL = Setting(
    "--responses-store-ttl", float, 3600.0, help="seconds a stored Responses API answer is kept"
)
HEALTH_INTERVAL = Setting("--health-interval", float, 2.0)
AUTH_TOKEN_FILE = Setting(
    "--auth-token-file",
    help="file holding the model's shared secret (authenticates the router to workers, signs bootstrap targets)",
)
VERIFY_INTERVAL = Setting(
    "--verify-interval",
    float,
    10.0,
    help="seconds between synthetic one-token requests that re-verify an idle prefill->decode pair; 0 turns "
    "verification off (then the router is ready while any prefill and decode are healthy)",
)
VERIFY_TIMEOUT = Setting("--verify-timeout", float, 60.0, help="seconds a pair verification may take")
HANDOFF_WINDOW = Setting("--handoff-window", float, 300.0, help="seconds of KV handoff failures /health counts")
STALL_AFTER = Setting(
    "--stall-after",
    float,
    60.0,
    help="seconds a worker's handoff queue may hold requests without progress before /health calls it stalled",
)
MAX_INFLIGHT = Setting(
    "--max-inflight",
    int,
    1024,
    help="client requests held at once; more get 429 with Retry-After (with --flow-control: they wait in its queue)",
)
FLOW_CONTROL = Setting(
    "--flow-control",
    bool,
    False,
    help="requests beyond --max-inflight wait in a queue instead of a 429: the highest priority first, flows "
    "(API keys, else x-gateway-inference-fairness-id) round-robin within a priority, the lowest shed first "
    "(docs/flow-control.md)",
)
FLOW_QUEUE_SIZE = Setting(
    "--flow-queue-size", int, 256, help="--flow-control: requests queued at most (beyond: the lowest priority is shed)"
)
FLOW_QUEUE_TTL = Setting(
    "--flow-queue-ttl", float, 30.0, help="--flow-control: seconds a request may wait in the queue before a 429"
)
FLOW_OBJECTIVES = Setting(
    "--flow-objectives",
    help="--flow-control: NAME=PRIORITY,... the objectives x-gateway-inference-objective may name (a negative "
    "priority is sheddable)",
)
FLOW_MIN_PRIORITY = Setting("--flow-min-priority", int, -10, help="--flow-control: the lowest priority allowed")
FLOW_MAX_PRIORITY = Setting("--flow-max-priority", int, 10, help="--flow-control: the highest priority allowed")
FLOW_KEY_PRIORITY = Setting(
    "--flow-key-priority",
    help="--flow-control: DIGEST=PRIORITY,... the highest priority each API key's requests get (higher asks are "
    "lowered to it); DIGEST: the key's SHA-256, its first 32 hex digits",
)
REQUEST_TIMEOUT = Setting(
    "--request-timeout",
    float,
    600.0,
    help="seconds one upstream request may take, its whole stream included; a choice that takes longer "
    "ends with an error event",
)
DRAIN_TIMEOUT = Setting(
    "--drain-timeout",
    float,
    30.0,
    help="on SIGTERM, seconds to finish open requests (new ones get 503) before cutting them short "
    "(the operator sets the pod's termination grace period from it)",
)
MAX_BODY_BYTES = Setting(
    "--max-body-bytes",
    int,
    0,
    help="request bodies beyond this get 413 (0: derived from the largest max_model_len the workers report "
    "on /v1/models, as the workers derive their own)",
)

# Flow control's settings (docs/flow-control.md): the operator's spec.router.flowControl and `serve --local` pass
# them to the router.
FLOW = (
    FLOW_CONTROL,
    FLOW_QUEUE_SIZE,
    FLOW_QUEUE_TTL,
    FLOW_OBJECTIVES,
    FLOW_MIN_PRIORITY,
    FLOW_MAX_PRIORITY,
    FLOW_KEY_PRIORITY,
)

# Before the static worker lists in --help, then the rest, in --help's order.
ROUTER_HEAD = (engine.HOST, engine.PORT, SERVED_MODEL_NAME)
ROUTER = (
    PREFILL_DNS,
    DECODE_DNS,
    BOOTSTRAP_PORT,
    POLICY,
    TOKENIZER,
    CACHE_AWARE_BALANCE_TOKENS,
    DECODE_ONLY_TOKENS,
    DP_GROUP_POLICY,
    RETRIES,
    MIGRATION_LIMIT,
    RESPONSES_STORE_SIZE,
    RESPONSES_STORE_BYTES,
    RESPONSES_STORE_TTL,
    STREAM_STALL_TIMEOUT,
    CLIENT_WRITE_TIMEOUT,
    STALL_HOLD,
    HEALTH_INTERVAL,
    engine.LOG_LEVEL,
    engine.API_KEY,
    engine.API_KEY_FILE,
    AUTH_TOKEN_FILE,
    VERIFY_INTERVAL,
    VERIFY_TIMEOUT,
    HANDOFF_WINDOW,
    STALL_AFTER,
    MAX_INFLIGHT,
    *FLOW,
    REQUEST_TIMEOUT,
    DRAIN_TIMEOUT,
    MAX_BODY_BYTES,
    engine.OTLP_TRACES_ENDPOINT,
    engine.OTLP_TRACES_SAMPLING_RATIO,
)
