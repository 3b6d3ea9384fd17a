"""The router: one OpenAI-compatible endpoint in front of prefill and decode instances.

Path of a request: parse the JSON -> split `n > 1` into n single-choice requests -> for each, pick a
healthy (prefill, decode) pair and a fresh random 63-bit bootstrap room -> send the request with
the bootstrap fields to both at once -> stream decode's answer. Until the first event has been
passed on to the client, a failed pair is retried on another pair with a new room; afterwards an
error ends the stream with an error event. A prefill 4xx (a prompt it cannot take) is the answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from disagg_worker.router.auth import RouterAuth
from disagg_worker.router.workers import Worker, WorkerPool
from disagg_worker.server.errors import APIError

log = logging.getLogger(__name__)

ROUTER: web.AppKey[Router] = web.AppKey("router")
STATUS_OF_TYPE = {"invalid_request_error": 400, "not_found_error": 404}
# After decode failed a request, how long prefill may take to refuse it with a better reason (a
# prefill refuses what it cannot take at once; one still waiting for a handshake is cancelled).
EXPLAIN_WAIT_S = 0.5


@dataclass
class Attempt:
    """What one pair answered before anything reached the client."""

    status: int
    body: dict
    retryable: bool


class Router:
    def __init__(
        self,
        pool: WorkerPool,
        model_name: str,
        retries: int = 2,
        request_timeout_s: float = 600.0,
        auth: RouterAuth | None = None,
    ):
        self.pool = pool
        self.model_name = model_name
        self.retries = retries
        self.auth = auth or RouterAuth()
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=5)
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the router is not started")
        return self._session

    async def start(self, health_interval_s: float = 2.0) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), headers=self.auth.worker_headers()
        )
        await self.pool.refresh_dns()
        await self.pool.check_health(self.session)
        self._watch = asyncio.create_task(self.pool.watch(self.session, health_interval_s))

    async def stop(self) -> None:
        self._watch.cancel()
        await self.session.close()

    # ---- one choice -----------------------------------------------------------------------
    async def open(self, path: str, body: dict) -> tuple[aiohttp.ClientResponse, asyncio.Task, bytes, list[Worker]]:
        """Find a pair that starts answering; return decode's response and its first bytes."""
        tried: set[Worker] = set()
        last = Attempt(503, APIError(503, "no healthy prefill/decode pair", type="server_error").body(), True)
        for _ in range(self.retries + 1):
            pair = self.pool.pick_pair(exclude=tried)
            if pair is None:
                break
            tried.update(pair)
            opened = await self._try_pair(path, body, *pair)
            if isinstance(opened, Attempt):
                last = opened
                if not opened.retryable:
                    break
                continue
            return opened
        raise APIError(
            last.status,
            last.body.get("error", {}).get("message", "request failed"),
            type=last.body.get("error", {}).get("type", "server_error"),
            param=last.body.get("error", {}).get("param"),
            code=last.body.get("error", {}).get("code"),
        )

    async def _try_pair(self, path: str, body: dict, p: Worker, d: Worker):
        routed = self.auth.routed(body, p.host, p.bootstrap_port, secrets.randbits(63))
        prefill = asyncio.create_task(self._prefill(p, path, {**routed, "stream": False}))
        d.inflight += 1
        try:
            resp = await self.session.post(f"{d.url}{path}", json=routed, timeout=self.timeout)
            first = await self._first_event(resp) if resp.status == 200 else await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            d.inflight -= 1
            d.failures += 1
            prefill.cancel()
            return Attempt(502, APIError(502, f"decode {d.url} failed: {e!r}", type="server_error").body(), True)
        except BaseException:  # the client left: abort the prefill side too
            d.inflight -= 1
            prefill.cancel()
            raise
        error = self._error_in(resp.status, first)
        if error is None:
            return resp, prefill, first, [d]
        resp.release()
        d.inflight -= 1
        return await self._explain(error, prefill)

    async def _prefill(self, p: Worker, path: str, body: dict) -> Attempt:
        p.inflight += 1
        try:
            async with self.session.post(f"{p.url}{path}", json=body, timeout=self.timeout) as r:
                data = await r.read()
                return Attempt(r.status, _json_or_error(r.status, data), r.status >= 500)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            p.failures += 1
            return Attempt(502, APIError(502, f"prefill {p.url} unreachable: {e}", type="server_error").body(), True)
        finally:
            p.inflight -= 1

    @staticmethod
    async def _first_event(resp: aiohttp.ClientResponse) -> bytes:
        """For a stream, read up to the end of the first SSE event; otherwise the whole body."""
        if not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            return await resp.read()
        buf = b""
        while b"\n\n" not in buf:
            chunk = await resp.content.readany()
            if not chunk:
                break
            buf += chunk
        return buf

    @staticmethod
    def _error_in(status: int, first: bytes) -> Attempt | None:
        if status != 200:
            return Attempt(status, _json_or_error(status, first), status >= 500)
        text = first.decode(errors="replace").strip()
        if text.startswith("data: "):
            try:
                event = json.loads(text[6:].split("\n\n")[0])
            except ValueError:
                return None
            if isinstance(event, dict) and "error" in event:
                kind = event["error"].get("type", "server_error")
                status = STATUS_OF_TYPE.get(kind, 500)
                return Attempt(status, event, status >= 500)
        return None

    @staticmethod
    async def _explain(decode_error: Attempt, prefill: asyncio.Task) -> Attempt:
        """A prefill that refused the request explains a decode failure better than decode can."""
        try:
            p = await asyncio.wait_for(asyncio.shield(prefill), timeout=EXPLAIN_WAIT_S)
        except asyncio.TimeoutError:
            prefill.cancel()
            return decode_error
        if 400 <= p.status < 500:
            return p
        return decode_error


def _json_or_error(status: int, data: bytes) -> dict:
    try:
        body = json.loads(data)
        if isinstance(body, dict):
            return body
    except ValueError:
        pass
    return APIError(status, data.decode(errors="replace")[:500] or f"HTTP {status}", type="server_error").body()
