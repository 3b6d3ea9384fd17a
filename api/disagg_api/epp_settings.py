"""Every setting of `disagg epp`, the endpoint picker a Gateway API gateway asks which pod serves a request
(`disagg_worker.epp`), declared once.

Its parser is made from `EPP` (`disagg_worker.epp.args`; the static lists, `--endpoint URL` and `--prefill URL`, are
the flags spelled there). The pool is found and scored as the router finds and scores its workers, so those flags
are the router's own (`router_settings`): the same name, default and meaning. The ports are the conventional ones
of an endpoint picker (the Gateway API Inference Extension's: 9002 ext_proc, 9003 gRPC health, 9090 metrics).
"""

from __future__ import annotations

from disagg_api import router_settings as R
from disagg_api import settings as engine
from disagg_api.setting import Setting

GRPC_PORT = Setting(
    "--grpc-port",
    int,
    9002,
    help="port of the ext_proc service (envoy.service.ext_proc.v3.ExternalProcessor) the gateway calls",
)
GRPC_HEALTH_PORT = Setting(
    "--grpc-health-port",
    int,
    9003,
    help="port of the gRPC health service (grpc.health.v1: liveness, readiness, the ext_proc service's name)",
)
METRICS_PORT = Setting("--metrics-port", int, 9090, help="port of the Prometheus /metrics")
ENDPOINT_DNS = Setting(
    "--endpoint-dns",
    help="HOST:PORT of a headless Service of the pods that take client traffic (each A record an endpoint)",
)
PREFILL_DNS = Setting(
    "--prefill-dns",
    help="HOST:PORT of a headless Service of the prefill pods (each A record a prefill): P/D mode, as --prefill; the "
    "endpoints are then decodes, and each request names the prefill picked for it in x-prefiller-host-port",
)
MAX_QUEUE = Setting(
    "--max-queue",
    int,
    0,
    help="requests an endpoint may hold (the EPP's own open ones, or more when its /health reports more) before "
    "it takes no more; when every endpoint holds this many the request is shed with 429; 0: never shed",
)
FALLBACKS = Setting(
    "--fallbacks",
    int,
    0,
    help="endpoints named after the picked one in x-gateway-destination-endpoint, comma-separated (an ordered "
    "list a gateway may fall back along), the next ones by load; 0 for a gateway that takes one address there "
    "(Envoy's ORIGINAL_DST cluster reading the header)",
)

# Before the static endpoint list in --help, then the rest, in --help's order.
EPP_HEAD = (engine.HOST, GRPC_PORT, GRPC_HEALTH_PORT, METRICS_PORT, R.SERVED_MODEL_NAME)
EPP = (
    ENDPOINT_DNS,
    PREFILL_DNS,
    R.POLICY,
    R.TOKENIZER,
    R.CACHE_AWARE_BALANCE_TOKENS,
    R.DP_GROUP_POLICY,
    MAX_QUEUE,
    FALLBACKS,
    R.MAX_BODY_BYTES,
    R.HEALTH_INTERVAL,
    R.AUTH_TOKEN_FILE,
    engine.LOG_LEVEL,
)
