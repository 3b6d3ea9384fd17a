"""Bearer-token authentication of an HTTP app (router, monolithic server, prefill and decode workers).

OpenAI style: a request must carry `Authorization: Bearer <key>` with one of the accepted keys,
else it is answered 401 with OpenAI's error body (`invalid_api_key`). The probe paths stay open (the
kubelet's probes and the router's health checks carry no key): `/health`, and the router's `/ready` and
`/livez`, which say nothing but ok or not to a caller without a key (the router's `/health` and `/ready` name
workers only to key holders and the operator: `router/auth.py`); every other path, `/metrics` and
the admin routes (`/stats`, `/flush_cache`) included, is protected. Unknown paths are refused the
same way, so an unauthenticated caller learns nothing about which routes exist.

A request let in carries its caller (`caller_of`: a digest of its key), so that what it stores stays its own, and
whether that key is the router's (`from_peer`: a worker then follows the router's trace sampling, `tracing.py`).

Accepted keys: the API keys clients hold (`--api-key`, `--api-key-file`) and, on prefill and
decode, the router's worker token derived from the model's shared secret (`keys.WORKER`).
"""

from __future__ import annotations

import hashlib
import hmac

from aiohttp import web

from disagg_worker.request.errors import APIError

OPEN_PATHS = frozenset({"/health", "/ready", "/livez"})


# Who a request came from, as the API key it was let in with names it (a digest, never the key): what it stores
# (a Responses API answer) is its own.
CALLER = web.RequestKey("caller", str)


# Whether a request was let in with one of the peer keys (the router's worker token).
PEER = web.RequestKey("peer", bool)


def from_peer(request: web.Request) -> bool:
    return request.get(PEER, False)


def caller_of(request: web.Request) -> str:
    """The digest of the key `request` was let in with; "" where the app takes no keys (then all are one caller)."""
    return request.get(CALLER, "")


def unauthorized(message: str) -> web.Response:
    err = APIError(401, message, type="invalid_request_error", code="invalid_api_key")
    return web.json_response(err.body(), status=401, headers={"WWW-Authenticate": "Bearer"})


def authorized(header: str, accepted: tuple[bytes, ...]) -> bool:
    """Whether an Authorization header carries one of the accepted keys (each compared in constant time)."""
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    presented = token.strip().encode()
    return any([hmac.compare_digest(presented, key) for key in accepted])  # noqa: C419 - compare every key


def auth_middleware(keys: tuple[str, ...], peers: tuple[str, ...] = ()):
    """A middleware that lets through requests carrying one of `keys` (`keys` must not be empty) or of `peers`,
    marking the latter (`from_peer`)."""
    if not keys + peers or not all(keys + peers):
        raise ValueError("auth_middleware needs at least one non-empty key")
    accepted, peer_keys = tuple(k.encode() for k in keys + peers), tuple(k.encode() for k in peers)

    @web.middleware
    async def middleware(request: web.Request, handler):
        if request.path in OPEN_PATHS:
            return await handler(request)
        header = request.headers.get("Authorization", "")
        if not header:
            return unauthorized("You didn't provide an API key: send it as 'Authorization: Bearer KEY'.")
        if not authorized(header, accepted):
            return unauthorized("Incorrect API key provided.")
        request[CALLER] = hashlib.sha256(header.partition(" ")[2].strip().encode()).hexdigest()[:32]
        request[PEER] = bool(peer_keys) and authorized(header, peer_keys)
        return await handler(request)

    return middleware


def require_keys(app: web.Application, keys: tuple[str, ...], peers: tuple[str, ...] = ()) -> None:
    """Put authentication in front of every route of `app` (before it starts): its clients' `keys` and its
    `peers`' (the router's worker token); none: nothing changes."""
    if keys or peers:
        app.middlewares.insert(0, auth_middleware(keys, peers))
