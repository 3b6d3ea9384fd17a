"""A decode instance that performs the P/D hand-off itself, for a gateway whose endpoint picker chose it and named
the prefill in llm-d's header `x-prefiller-host-port` (docs/routing.md, "P/D through a gateway").

Path of such a request: the decode's admission, as any request's (`http/admission.py`: the client's request
holds a slot and its body's bytes) -> this part of the decode's app (`server/api.AppPart`, composed by the CLI,
which sits above both the server and the router) -> the header checked (`prefiller.py`: host:port, admitted by
`--prefill-allow`; else a 400 naming it) -> a router in front of one pair, the named prefill and this instance on
its own port, running the router's own handler (`server.make_handler`: n > 1 fanned out, streams relayed to their
[DONE]) -> the prefill leg, with the bootstrap fields signed as the router signs them and the worker token, and the
decode leg back to this instance's port, marked as a leg (`admission.LEG_HEADER`) so that it is not admitted twice
-> decode's answer to the client.

Between the legs the router's semantics hold (`app.py`): the client leaving cancels both legs; a prefill that
refuses a prompt (4xx) gives the answer; one that fails or cannot be reached fails the request with a 5xx that
names the request id, decode's leg cancelled at once so that its pages and room are freed; a decode leg that fails
after its stream started ends the stream with an error event and [DONE]. There is no other pair to retry on or
migrate to: the gateway picked this one, and a retry is its to make.

A request without the header is the instance's own, served as it always was (a decode instance takes only
requests that carry their bootstrap fields: a router's, or a sidecar's that called prefill itself). The Responses
API is not handed off: its store is the router's (`router/responses.py`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler

from disagg_api import router_settings as R
from disagg_worker import keys
from disagg_worker.config import ServerArgs
from disagg_worker.http.admission import LEG_HEADER
from disagg_worker.http.errors import request_id
from disagg_worker.request.errors import APIError
from disagg_worker.router.app import Router
from disagg_worker.router.auth import RouterAuth
from disagg_worker.router.prefiller import HEADER, AllowList, NameResolver, Prefiller, bad_header, checked
from disagg_worker.router.server import make_handler
from disagg_worker.router.worker import Worker
from disagg_worker.router.workers import WorkerPool
from disagg_worker.server.api import ADMISSION

log = logging.getLogger(__name__)
PATHS = ("/v1/chat/completions", "/v1/completions", "/generate")
NOT_HANDED_OFF = "/v1/responses"
# Where a handed-off request keeps the router of its pair, for the router's handler (`make_handler`'s `router_of`).
_PAIR = "disagg.handoff_pair"
# Interfaces a server listening on them is reached at over loopback.
_ANY = ("", "0.0.0.0", "::")


def pair_router(request: web.Request) -> Router:
    return request[_PAIR]


HANDLERS = {path: make_handler(path, router_of=pair_router) for path in PATHS}


@dataclass
class DecodeHandOff:
    """The hand-off of one decode instance: where its own legs reach it, the prefills' bootstrap port, the
    allow-list, and the router's keys (derived from the model's secret, as the router derives them)."""

    model_name: str
    own_url: str
    bootstrap_port: int
    allow: AllowList
    auth: RouterAuth = field(default_factory=RouterAuth)
    request_timeout_s: float = R.REQUEST_TIMEOUT.default
    client_write_timeout_s: float = R.CLIENT_WRITE_TIMEOUT.default
    resolver: NameResolver = field(default_factory=NameResolver)
    _session: aiohttp.ClientSession | None = None

    @classmethod
    def of(cls, args: ServerArgs) -> DecodeHandOff:
        """The hand-off of the decode instance `args` start (a bad --prefill-allow: ConfigError)."""
        d = args.engine.disagg
        host = "127.0.0.1" if args.host in _ANY else args.host
        kv_key, kv_key_id = keys.kv_names(d.auth_token)
        auth = RouterAuth(worker_token=d.worker_token, target_key=d.target_key, kv_key=kv_key, kv_key_id=kv_key_id)
        own = Prefiller(host, args.port).url  # the same spelling rules (an IPv6 host in brackets)
        return cls(args.engine.model_name, own, d.bootstrap_port, AllowList.parse(d.prefill_allow), auth)

    async def context(self, app: web.Application) -> AsyncIterator[None]:
        """The legs' one session while the app runs (each leg carries the worker token, as the router's do)."""
        connector = aiohttp.TCPConnector(limit=0)
        self._session = aiohttp.ClientSession(connector=connector, headers=self.auth.worker_headers())
        try:
            yield
        finally:
            await self._session.close()

    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        value = request.headers.get(HEADER)
        if value is None:
            return await handler(request)
        if request.path == NOT_HANDED_OFF:
            raise bad_header(f"is taken on {', '.join(PATHS)}; send the Responses API to the model's router")
        if request.path not in HANDLERS:
            return await handler(request)
        prefiller = await checked(value, self.allow, self.resolver)
        request[_PAIR] = self.router(prefiller, request)
        try:
            return await HANDLERS[request.path](request)
        except APIError as e:
            if e.status < 500:
                raise
            rid = request_id(request)
            log.warning("request %s handed off to prefill %s failed: %s", rid, prefiller.url, e.message)
            raise APIError(
                e.status, f"request {rid}: {e.message}", e.type, e.param, e.code, retry_after=e.retry_after
            ) from None

    def router(self, p: Prefiller, request: web.Request) -> Router:
        """A router in front of one pair: the named prefill, and this instance (its legs marked as such)."""
        if self._session is None:
            raise RuntimeError("the hand-off serves only while its app runs")
        prefill = Worker(p.url, "prefill", self.bootstrap_port, healthy=True)
        decode = Worker(self.own_url, "decode", healthy=True)
        leg = {LEG_HEADER: request.app[ADMISSION].leg_token}
        if not self.auth.worker_token and "Authorization" in request.headers:
            leg["Authorization"] = request.headers["Authorization"]  # without a secret: the client's key, let in here
        return Router(
            WorkerPool(static=[prefill, decode]),
            self.model_name,
            retries=0,
            request_timeout_s=self.request_timeout_s,
            client_write_timeout_s=self.client_write_timeout_s,
            auth=self.auth,
            session=self._session,
            decode_headers=leg,
        )
