"""`disagg epp`: the endpoint picker's processes in one event loop — the ext_proc service a gateway calls
(`envoy.service.ext_proc.v3.ExternalProcessor/Process`, --grpc-port, one `Exchange` per request), gRPC health
(--grpc-health-port, and on the ext_proc port too: `liveness`, `readiness`, the ext_proc service's name), the
Prometheus /metrics (--metrics-port), and the watch of the pool: membership (DNS of a headless Service and the
static --endpoint list; in P/D mode the prefills' too, --prefill-dns and --prefill), health and KV events, each
--health-interval, exactly as the router watches its workers (`router/workers.py`). Readiness follows the pool:
SERVING while at least one endpoint is healthy (in P/D mode, and at least one prefill).

SIGTERM or SIGINT: readiness and the ext_proc service turn NOT_SERVING, then the servers stop, giving open
streams a grace to finish.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator

import aiohttp
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import start_http_server

from disagg_worker import keys
from disagg_worker.epp.exchange import Exchange, Reader
from disagg_worker.epp.generated.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from disagg_worker.epp.generated.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from disagg_worker.epp.metrics import EppMetrics
from disagg_worker.epp.pick import DECODE, PREFILL, ROLE, Picker
from disagg_worker.router.auth import RouterAuth
from disagg_worker.router.discovery import DnsSource
from disagg_worker.router.policies import Policy
from disagg_worker.router.prompt import PromptTokens
from disagg_worker.router.worker import GroupPolicy, Worker
from disagg_worker.router.workers import WorkerPool
from disagg_worker.tuning import TUNING

log = logging.getLogger(__name__)
EXT_PROC = pb.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
LIVENESS, READINESS = "liveness", "readiness"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
STOP_GRACE_S = 5.0


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, picker: Picker, reader: Reader, metrics: EppMetrics):
        self.picker, self.reader, self.metrics = picker, reader, metrics

    async def Process(  # noqa: N802 - the gRPC method's name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        exchange = Exchange(self.picker, self.reader, self.metrics)
        try:
            async for req in request_iterator:
                for answer in await exchange.answer(req):
                    yield answer
                    if answer.HasField("immediate_response"):
                        return  # the gateway answers the client: nothing more of this request comes
        finally:
            exchange.close()


def pd_mode(ns) -> bool:
    """Prefills are configured: the endpoints are decodes."""
    return bool(ns.prefill or ns.prefill_dns)


def build_pool(ns) -> WorkerPool:
    """The pool of the endpoints (`--endpoint`, `--endpoint-dns`), and in P/D mode of the prefills (`--prefill`,
    `--prefill-dns`), scored by `--policy`."""
    role = DECODE if pd_mode(ns) else ROLE
    static = [Worker(url.rstrip("/"), role) for url in ns.endpoint or []]
    static += [Worker(url.rstrip("/"), PREFILL) for url in ns.prefill or []]
    dns = [DnsSource.parse(ns.endpoint_dns, role)] if ns.endpoint_dns else []
    dns += [DnsSource.parse(ns.prefill_dns, PREFILL)] if ns.prefill_dns else []
    pool = WorkerPool(static=static, dns=dns, policy=Policy(ns.policy), group_policy=GroupPolicy(ns.dp_group_policy))
    pool.balance_tokens = ns.cache_aware_balance_tokens
    # A round waits for its slowest endpoint (a /health and a /kv_events timeout): an index is silent only after it
    # missed more than that (as the router's).
    pool.kv_index.stale_after_s = max(
        3 * ns.health_interval, ns.health_interval + 2 * TUNING.router.health_timeout_s + 1
    )
    return pool


async def watch(picker: Picker, session: aiohttp.ClientSession, interval_s: float, status) -> None:
    """Keep the pool current (`WorkerPool.watch`'s round) and readiness with it, until cancelled."""
    pool = picker.pool
    while True:
        try:
            await pool.refresh_dns()
            await pool.check_health(session)
        except Exception:  # one failed round must not stop the watching
            log.exception("endpoint refresh failed")
        await status(READINESS, SERVING if picker.ready() else NOT_SERVING)
        await asyncio.sleep(interval_s)


async def serve(ns, auth: RouterAuth, started: asyncio.Event | None = None) -> None:
    pool = build_pool(ns)
    pool.worker_headers = auth.worker_headers()
    pool.kv_index.key_id = auth.kv_key_id  # the workers name their cached pages with the model's key
    picker = Picker(
        pool, max_queue=ns.max_queue, fallbacks=ns.fallbacks, max_body_bytes=ns.max_body_bytes, pd=pd_mode(ns)
    )
    policy_reads = ns.policy == Policy.CACHE_AWARE.value and ns.tokenizer
    reader = Reader(ns.served_model_name, PromptTokens.load(ns.tokenizer) if policy_reads else None, auth.kv_key)
    metrics = EppMetrics(pool)
    health_servicer = health.aio.HealthServicer()
    for name in (LIVENESS, EXT_PROC, ""):
        await health_servicer.set(name, SERVING)
    await health_servicer.set(READINESS, NOT_SERVING)

    main = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(picker, reader, metrics), main)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, main)
    main.add_insecure_port(f"{ns.host}:{ns.grpc_port}")
    probes = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, probes)
    probes.add_insecure_port(f"{ns.host}:{ns.grpc_health_port}")
    start_http_server(ns.metrics_port, ns.host, registry=metrics.registry)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=pool.worker_headers) as session:
        watching = asyncio.create_task(watch(picker, session, ns.health_interval, health_servicer.set))
        await main.start()
        await probes.start()
        print(f"disagg epp: ext_proc on {ns.host}:{ns.grpc_port}, health on {ns.grpc_health_port}", flush=True)
        if started is not None:
            started.set()
        try:
            await stop.wait()
        finally:
            for name in (READINESS, EXT_PROC):
                await health_servicer.set(name, NOT_SERVING)
            watching.cancel()
            await main.stop(STOP_GRACE_S)
            await probes.stop(0)


def worker_auth(ns) -> RouterAuth:
    """The keys the picker holds: the worker token its calls to the endpoints carry and the key the endpoints
    name their cached pages with, both from the model's shared secret (--auth-token-file); it takes no client
    keys (the gateway's clients are the endpoints' to authenticate) and signs no targets."""
    secret = keys.read_secret(ns.auth_token_file, "--auth-token-file") if ns.auth_token_file else ""
    kv_key, kv_key_id = keys.kv_names(secret)
    return RouterAuth(
        worker_token=keys.derive(secret, keys.WORKER) if secret else "", kv_key=kv_key, kv_key_id=kv_key_id
    )


def run(ns) -> None:
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s epp %(levelname)s %(message)s")
    auth = worker_auth(ns)  # before anything starts: a key asked for but missing stops here
    if ns.policy == Policy.CACHE_AWARE.value and not ns.tokenizer:
        raise SystemExit("disagg epp: --policy cache_aware needs --tokenizer (the served model's directory or GGUF)")
    if not ns.endpoint and not ns.endpoint_dns:
        raise SystemExit(
            "disagg epp: name the pool's endpoints: --endpoint URL (repeatable) or --endpoint-dns HOST:PORT"
        )
    asyncio.run(serve(ns, auth))
