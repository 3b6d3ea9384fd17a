"""HTTP handlers of the router, and its entry point.

Generation requests pass the same admission gate as a worker's (`http/admission.py`: 503 while
the router drains, 429 beyond --max-inflight or the bytes of bodies held at once, 413 beyond the body
limit; the body is read, within a time limit, before the request takes a slot; with --flow-control, a request
beyond --max-inflight waits in a queue by priority and flow instead: `router/flow_control.py`). On SIGTERM the
router drains (`http/drain.py`): /health and /ready fail, new requests get 503, open streams finish within
--drain-timeout, then it exits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from disagg_worker.http.admission import CLIENT_BODY_BUDGET_BYTES, DRAINING, Admission, body_of
from disagg_worker.http.auth import require_keys
from disagg_worker.http.drain import CUT_GRACE_S, Signals, drain
from disagg_worker.http.flow_gate import priority_of
from disagg_worker.http.middlewares import with_tracing
from disagg_worker.request.errors import APIError
from disagg_worker.router.app import ROUTER, Opened, Router
from disagg_worker.router.auth import RouterAuth
from disagg_worker.router.batch import as_batch_prompt, prompt_bodies, valid_n
from disagg_worker.router.discovery import DnsSource
from disagg_worker.router.echo import check_echo_bound, scores_prompt, with_prompt_logprobs
from disagg_worker.router.fanout import merge_bodies, stream_merged
from disagg_worker.router.flow_control import flow_control
from disagg_worker.router.handoff import HandoffMonitor
from disagg_worker.router.metrics import metrics_handler
from disagg_worker.router.migrate import MigratingChoice, migrates, with_token_ids
from disagg_worker.router.passthrough import add_pass_through
from disagg_worker.router.payload import SharedBody
from disagg_worker.router.policies import Policy
from disagg_worker.router.policies.prefix import Prompt
from disagg_worker.router.prompt import PromptTokens
from disagg_worker.router.responses import add_responses
from disagg_worker.router.stream import DONE, UpstreamLost, choice_events, error_event, relay, sse_response
from disagg_worker.router.verify import PairVerifier
from disagg_worker.router.worker import GroupPolicy, Worker
from disagg_worker.router.workers import WorkerPool
from disagg_worker.server.protocol import parse_json
from disagg_worker.server.response_store import ResponseStore
from disagg_worker.tracing import Tracer
from disagg_worker.tuning import TUNING

log = logging.getLogger(__name__)
INLINE_BODY_BYTES = 64 * 1024
ADMISSION = web.AppKey("admission", Admission)


def build_router_app(router: Router, admission: Admission, responses: ResponseStore | None = None) -> web.Application:
    app = web.Application(middlewares=with_tracing(router.tracer, admission), client_max_size=64 * 1024 * 1024)
    app[ROUTER] = router
    app[ADMISSION] = admission
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        app.router.add_post(path, make_handler(path))
    add_pass_through(app)
    add_responses(app, responses if responses is not None else ResponseStore())
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/livez", livez)
    app.router.add_get("/metrics", metrics_handler(router.pool, router.verifier, admission.flow))
    return app


@dataclass(frozen=True)
class Part:
    """One prompt of a request (the request itself, but for a completions batch): its body serialised once for
    every upstream request, and its prompt for the cache-aware policy."""

    body: SharedBody
    prompt: Prompt | None


def parse_request(raw: bytes, router: Router, path: str, priority: int | None = None) -> tuple[list[Part], Any]:
    """The request's prompts (`batch.py`: one unless a completions batch) and its `n`; `priority`: what flow control
    gave the request (`flow_gate.priority_of`), written over the body's for the workers."""
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    if priority is not None:
        body["priority"] = priority
    check_echo_bound(path, body, router.prompts)
    parts = [Part(SharedBody.of(b), router.prompt_of(path, b)) for b in prompt_bodies(path, body)]
    return parts, body.get("n", 1)


def app_router(request: web.Request) -> Router:
    return request.app[ROUTER]


def make_handler(path: str, router_of: Callable[[web.Request], Router] = app_router):
    """The handler of generation path `path`, sending each request on through `router_of(request)` (the app's
    router; a decode instance's hand-off gives each request a router of its own pair, `decode_handoff.py`)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        router = router_of(request)
        raw = body_of(request)
        # A large body is parsed, serialised (and tokenised) on a thread: the loop keeps serving the other streams.
        inline = len(raw) <= INLINE_BODY_BYTES and router.prompts is None
        args = (raw, router, path, priority_of(request))
        parts, n = parse_request(*args) if inline else await asyncio.to_thread(parse_request, *args)
        del raw  # from here on, the one serialised copy is the request
        if len(parts) > 1 or (path != "/generate" and valid_n(n) and n > 1):
            return await fan_out(request, router, path, parts, n)
        return await proxy_one(request, router, path, parts[0].body, parts[0].prompt)

    return handler


async def proxy_one(
    request: web.Request, router: Router, path: str, body: SharedBody, prompt: Prompt | None = None
) -> web.StreamResponse:
    if migrates(router, path, body):
        return await proxy_migrating(request, router, path, body, prompt)
    o = await router.open(path, body, {}, prompt)
    try:
        if scores_prompt(path, body):
            await with_prompt_logprobs(o, router.request_timeout_s)
        if not o.resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            return web.Response(body=o.first, status=o.resp.status, content_type="application/json")
        out = await sse_response(request, router.client_write_timeout_s)
        try:
            await relay(out, o.first, o.resp)
        except UpstreamLost as e:
            log.warning("decode %s: %s", o.decode.url, e.message)
            await out.write(error_event(router.cut_reason or e.message))
            await out.write(DONE)
        return out
    except (asyncio.CancelledError, ConnectionResetError):
        if o.prefill is not None:
            o.prefill.cancel()  # the client left (or stopped reading: `ClientStream`): abort the prefill side too
        raise
    finally:
        router.close(o)


async def proxy_migrating(
    request: web.Request, router: Router, path: str, body: SharedBody, prompt: Prompt | None = None
) -> web.StreamResponse:
    """One streamed choice that goes on on another pair when its decode fails (`migrate.py`)."""
    choice = with_token_ids(router, path, body, {})
    c = MigratingChoice(router, path, body, choice, await router.open(path, body, choice, prompt), prompt)
    try:
        out = await sse_response(request, router.client_write_timeout_s)
        try:
            async for event in c.events():
                await out.write(f"data: {json.dumps(event)}\n\n".encode())
        except UpstreamLost as e:
            log.warning("%s: %s", c.response_id or "a stream", e.message)
            await out.write(error_event(router.cut_reason or e.message))
        except APIError as e:  # no pair took the migrated request
            await out.write(error_event(e.message))
        await out.write(DONE)
        return out
    except (asyncio.CancelledError, ConnectionResetError):
        c.cancel()
        raise
    finally:
        c.close()


def choice_fields(body: SharedBody, i: int) -> dict[str, Any]:
    """Choice i of n: one choice, and a seeded request's seed + i."""
    seed = body.fields.get("seed")
    return {"n": 1, "seed": seed + i} if type(seed) is int else {"n": 1}


async def fan_out(request: web.Request, router: Router, path: str, parts: list[Part], n: int) -> web.StreamResponse:
    """Each prompt's n choices = n single-choice requests, each on its own pair and bootstrap room (each migrating
    alone); prompt i's choice j is choice i * n + j of the answer. The first choice that fails to start is the
    answer."""
    choices = [(p, with_token_ids(router, path, p.body, choice_fields(p.body, j))) for p in parts for j in range(n)]
    opened = await asyncio.gather(*(router.open(path, p.body, c, p.prompt) for p, c in choices), return_exceptions=True)
    migrating = [
        MigratingChoice(router, path, p.body, c, o, p.prompt)
        for (p, c), o in zip(choices, opened, strict=True)
        if isinstance(o, Opened) and migrates(router, path, p.body)
    ]
    first = parts[0].body
    try:
        ok = [o for o in opened if isinstance(o, Opened)]
        failed = next(((k, o) for k, o in enumerate(opened) if isinstance(o, BaseException)), None)
        if failed is not None:
            k, e = failed
            raise as_batch_prompt(e, k // n) if len(parts) > 1 else e
        if scores_prompt(path, first):
            await asyncio.gather(*(with_prompt_logprobs(o, router.request_timeout_s) for o in ok))
        if first.fields.get("stream") is not True:
            return web.json_response(merge_bodies([json.loads(o.first) for o in ok], n))
        out = await sse_response(request, router.client_write_timeout_s)
        streams = [c.events() for c in migrating] or [choice_events(o.first, o.resp) for o in ok]
        await stream_merged(out, streams, n, lambda: router.cut_reason)
        return out
    except (asyncio.CancelledError, ConnectionResetError):  # the client left, or stopped reading: abort prefills too
        for c in migrating:
            c.cancel()
        for o in opened:
            if isinstance(o, Opened) and o.prefill is not None:
                o.prefill.cancel()
        raise
    finally:
        for c in migrating:
            c.close()
        for o in opened:
            if isinstance(o, Opened) and not migrating:
                router.close(o)


async def models(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    model: dict[str, Any] = {"id": router.model_name, "object": "model", "created": 0, "owned_by": "disagg"}
    known = [w.max_model_len for w in router.pool.workers() if w.max_model_len]
    if known:
        model["max_model_len"] = max(known)
    # The LoRA adapters the workers serve, each with the model as its parent (vLLM's shape, as a worker lists them).
    adapters = [{**model, "id": a, "parent": router.model_name} for a in router.pool.adapters()]
    return web.json_response({"object": "list", "data": [model, *adapters]})


async def health(request: web.Request) -> web.Response:
    """200 while a prefill->decode pair is verified (without verification: while a prefill and a decode
    instance are healthy) and the router does not drain; the operator reads it for PairingVerified. Lists every
    worker, and every pair with its last result and its age. Readiness is `/ready`."""
    router = request.app[ROUTER]
    pool, verifier = router.pool, router.verifier
    now = time.monotonic()
    body: dict = {"workers": [w.describe(now) for w in pool.workers()]}
    if pool.policy is Policy.CACHE_AWARE:
        for w, d in zip(pool.workers(), body["workers"], strict=True):
            if pool.indexed(w):
                d["kv_index"] = pool.kv_index.describe(w.url, now)
        body["routing"] = {**pool.decisions, **{f"routed_{k}": n for k, n in pool.routes.items()}}
    if verifier is not None:
        body.update(pairs=verifier.describe(), handoff=verifier.monitor.describe())
    if not router.auth.shows_health_details(request.headers.get("Authorization", "")):
        body = {}  # with API keys, the addresses and errors are for key holders: a probe reads the status
    if request.app[ADMISSION].draining:
        return web.json_response({"status": DRAINING, **body}, status=503)
    ok = router.has_pair()
    return web.json_response({"status": "ok" if ok else "unhealthy", **body}, status=200 if ok else 503)


async def ready(request: web.Request) -> web.Response:
    """The readiness probe: 200 once the router has had a pair (`Router.takes_requests`) until it drains. An open
    path: while not ready, its reason names pods and addresses only to a caller `RouterAuth.shows_health_details`
    lets see them."""
    router = request.app[ROUTER]
    if request.app[ADMISSION].draining:
        return web.json_response({"status": DRAINING}, status=503)
    if not router.takes_requests():
        why = router.no_pair()  # generic; why no pair serves goes to the log, which names the workers
        # ... and to whoever may see /health's pairs: with API keys, a key holder or the operator, not a probe.
        if router.verifier is not None and router.auth.shows_health_details(request.headers.get("Authorization", "")):
            why = f"{why} ({router.verifier.unready_reason()})"
        return web.json_response({"status": "unhealthy", "reason": why}, status=503)
    return web.json_response({"status": "ok", "pair": router.has_pair()})


async def livez(request: web.Request) -> web.Response:
    """Alive as long as it answers: a router without a verified pair is not ready, but it needs no restart."""
    return web.json_response({"status": "alive"})


def parse_static(specs: list[list[str]], role: str) -> list[Worker]:
    """`--prefill URL [BOOTSTRAP_PORT]` / `--decode URL`."""
    workers = []
    for spec in specs or []:
        url = spec[0].rstrip("/")
        port = int(spec[1]) if role == "prefill" and len(spec) > 1 else 0
        workers.append(Worker(url, role, port))
    return workers


def build_pool(ns) -> WorkerPool:
    static = parse_static(ns.prefill, "prefill") + parse_static(ns.decode, "decode")
    dns = []
    if ns.prefill_dns:
        dns.append(DnsSource.parse(ns.prefill_dns, "prefill", ns.bootstrap_port))
    if ns.decode_dns:
        dns.append(DnsSource.parse(ns.decode_dns, "decode"))
    for w in static:
        if w.role == "prefill" and not w.bootstrap_port:
            w.bootstrap_port = ns.bootstrap_port
    return WorkerPool(static=static, dns=dns, policy=Policy(ns.policy), group_policy=GroupPolicy(ns.dp_group_policy))


def build_verifier(ns, pool: WorkerPool, auth: RouterAuth) -> PairVerifier | None:
    if ns.verify_interval <= 0:
        return None
    monitor = HandoffMonitor(ns.handoff_window, ns.stall_after)
    return PairVerifier(pool, ns.verify_interval, ns.verify_timeout, monitor=monitor, auth=auth)


async def serve(ns, auth: RouterAuth, ready: asyncio.Event | None = None) -> None:
    signals = Signals()
    flow = flow_control(ns)  # before anything starts: a malformed --flow-* flag stops here
    pool = build_pool(ns)
    pool.worker_headers = auth.worker_headers()
    # A health round waits for its slowest worker (up to a /health and a /kv_events timeout): an index is silent
    # only after it missed more than that.
    pool.kv_index.stale_after_s = max(
        3 * ns.health_interval, ns.health_interval + 2 * TUNING.router.health_timeout_s + 1
    )
    pool.balance_tokens = ns.cache_aware_balance_tokens
    pool.decode_only_tokens = ns.decode_only_tokens
    router = Router(
        pool,
        ns.served_model_name,
        retries=ns.retries,
        request_timeout_s=ns.request_timeout,
        verifier=build_verifier(ns, pool, auth),
        auth=auth,
        max_body_bytes=ns.max_body_bytes,
        migration_limit=ns.migration_limit,
        stall_s=ns.stream_stall_timeout or None,
        stall_hold_s=ns.stall_hold,
        client_write_timeout_s=ns.client_write_timeout or None,
        # Only cache_aware reads prompts: other policies tokenise nothing, even when given --tokenizer.
        prompts=PromptTokens.load(ns.tokenizer) if ns.policy == Policy.CACHE_AWARE.value and ns.tokenizer else None,
        tracer=Tracer.create("router", ns.otlp_traces_endpoint, ns.otlp_traces_sampling_ratio),
    )
    await router.start(ns.health_interval)
    admission = Admission(ns.max_inflight, router.body_limit, client_budget=CLIENT_BODY_BUDGET_BYTES, flow=flow)
    store = ResponseStore(ns.responses_store_size, ns.responses_store_ttl, max_bytes=ns.responses_store_bytes)
    app = build_router_app(router, admission, store)
    require_keys(app, auth.api_keys)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=CUT_GRACE_S)
    await runner.setup()
    await web.TCPSite(runner, ns.host, ns.port).start()
    print(f"disagg router on http://{ns.host}:{ns.port}", flush=True)

    async def cut(reason: str) -> None:
        router.cut(reason)

    try:
        await signals.stop.wait()
        await drain(admission, ns.drain_timeout, cut, signals.hurry)
    finally:
        await runner.cleanup()
        await router.stop()
        if router.tracer is not None:
            router.tracer.shutdown()


def run(ns) -> None:
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s router %(levelname)s %(message)s")
    auth = RouterAuth.from_cli(ns)  # before anything starts: a key asked for but missing stops here
    if ns.policy == Policy.CACHE_AWARE.value and not ns.tokenizer:
        raise SystemExit("disagg router: --policy cache_aware needs --tokenizer (the served model's directory or GGUF)")
    if ns.decode_only_tokens and ns.policy != Policy.CACHE_AWARE.value:
        raise SystemExit("disagg router: --decode-only-tokens needs --policy cache_aware (which reads the prompts)")
    asyncio.run(serve(ns, auth))
