"""The router's command line (`disagg router`)."""

from __future__ import annotations

from disagg_worker.router.auth import add_auth_args
from disagg_worker.router.workers import GroupPolicy, Policy
from disagg_worker.server.response_store import DEFAULT_MAX_AGE_S, DEFAULT_MAX_ENTRIES


def add_router_args(p) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default="default")
    p.add_argument(
        "--prefill",
        nargs="+",
        action="append",
        metavar=("URL", "BOOTSTRAP_PORT"),
        help="a prefill instance and its bootstrap port (repeatable)",
    )
    p.add_argument("--decode", nargs=1, action="append", metavar="URL", help="a decode instance (repeatable)")
    p.add_argument("--prefill-dns", default="", help="HOST:PORT of a headless Service of prefill pods")
    p.add_argument("--decode-dns", default="", help="HOST:PORT of a headless Service of decode pods")
    p.add_argument("--bootstrap-port", type=int, default=8998)
    p.add_argument(
        "--policy",
        default=Policy.ROUND_ROBIN.value,
        choices=[p.value for p in Policy],
        help="cache_aware: prefill by the prompt tokens a worker has not cached plus this router's prefill tokens "
        "running there (the workers' GET /kv_events), decode by least load; needs --tokenizer",
    )
    p.add_argument("--tokenizer", default="", help="the model (directory or GGUF) whose tokenizer cache_aware uses")
    p.add_argument(
        "--cache-aware-balance-tokens",
        type=int,
        default=4096,
        help="cache_aware: while a prefill worker is idle, one with this many prompt tokens pending takes no more",
    )
    p.add_argument(
        "--decode-only-tokens",
        type=int,
        default=0,
        help="cache_aware: a decode lacking at most this many of a prompt's tokens computes them itself, with no "
        "prefill (conditional disaggregation; decode runs with --local-prefill); 0: off",
    )
    p.add_argument(
        "--dp-group-policy",
        default=GroupPolicy.LOAD.value,
        choices=[p.value for p in GroupPolicy],
        help="workers with DP attention: pick a request's attention group by load (the fewest of this router's "
        "requests open on it, then the worker's reported load; under --policy cache_aware a prefill's group by "
        "its cache first) or by bootstrap_room %% dp_size",
    )
    p.add_argument("--retries", type=int, default=2)
    p.add_argument(
        "--migration-limit",
        type=int,
        default=3,
        help="times a streamed choice whose decode fails goes on on another pair, from its last token (the client's "
        "stream continues); 0: such a stream ends with an error event",
    )
    p.add_argument(
        "--responses-store-size",
        type=int,
        default=DEFAULT_MAX_ENTRIES,
        help="Responses API answers kept for previous_response_id and GET /v1/responses/{id} (the oldest go first; "
        "0 keeps none); each router replica keeps its own",
    )
    p.add_argument(
        "--responses-store-ttl",
        type=float,
        default=DEFAULT_MAX_AGE_S,
        help="seconds a stored Responses API answer is kept",
    )
    p.add_argument(
        "--stream-stall-timeout",
        type=float,
        default=60.0,
        help="seconds a decode stream may send nothing before the router counts its decode as failed (and migrates "
        "the stream); 0: only --request-timeout ends it",
    )
    p.add_argument("--health-interval", type=float, default=2.0)
    p.add_argument("--log-level", default="info")
    add_auth_args(p)
    p.add_argument(
        "--verify-interval",
        type=float,
        default=10.0,
        help="seconds between synthetic one-token requests that re-verify an idle prefill->decode pair; 0 turns "
        "verification off (then the router is ready while any prefill and decode are healthy)",
    )
    p.add_argument("--verify-timeout", type=float, default=60.0, help="seconds a pair verification may take")
    p.add_argument("--handoff-window", type=float, default=300.0, help="seconds of KV handoff failures /health counts")
    p.add_argument(
        "--stall-after",
        type=float,
        default=60.0,
        help="seconds a worker's handoff queue may hold requests without progress before /health calls it stalled",
    )
    p.add_argument(
        "--max-inflight",
        type=int,
        default=1024,
        help="client requests held at once; more get 429 with Retry-After",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds one upstream request may take, its whole stream included; a choice that takes longer "
        "ends with an error event",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to finish open requests (new ones get 503) before cutting them short "
        "(the operator sets the pod's termination grace period from it)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=0,
        help="request bodies beyond this get 413 (0: derived from the largest max_model_len the workers report "
        "on /v1/models, as the workers derive their own)",
    )
