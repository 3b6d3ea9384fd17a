"""The router: one OpenAI-compatible endpoint in front of prefill and decode instances.

Path of a request: admission (in-flight bound, body limit: `server.py`) -> parse the JSON ->
serialise it once (`payload.py`) -> split `n > 1` into n single-choice requests -> for each, pick
a healthy (prefill, decode) pair (both serving its LoRA adapter, if `model` names one) and a fresh random 63-bit
bootstrap room -> send the request with
the bootstrap fields to both at once -> stream decode's answer (`stream.py`). With conditional
disaggregation (`policies/cache_aware.py`), a decode that lacks few of the prompt's tokens gets the request
alone, marked `local_prefill`, and computes them itself.

Until the first event has been passed on to the client, a failed pair is retried on another pair
with a new room: a decode that fails, or a prefill that refuses first (5xx, 429, or 503 while it
drains; decode's half is then cancelled at once instead of waiting for KV that never comes). A
worker that answers "draining" is not picked again until its /health is 200. A prefill 4xx (a
prompt it cannot take) is the answer. Afterwards a failure ends the stream with an error event.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import aiohttp
from aiohttp import web

from disagg_worker.http.admission import DRAINING, RETRY_AFTER_S
from disagg_worker.request import route
from disagg_worker.request.errors import INSTANCE_FAILED, APIError, unavailable
from disagg_worker.request.limits import body_limit_bytes
from disagg_worker.router.attempt import Attempt, Opened, error_in, first_event, json_or_error
from disagg_worker.router.auth import RouterAuth
from disagg_worker.router.hops import NO_HOP, Hop
from disagg_worker.router.payload import JoinedPayload, SharedBody
from disagg_worker.router.policies.prefix import Prompt
from disagg_worker.router.prompt import PromptTokens, prompt_of
from disagg_worker.router.stream import lost
from disagg_worker.router.verify import PairVerifier
from disagg_worker.router.worker import Worker
from disagg_worker.router.workers import WorkerPool
from disagg_worker.tracing import Tracer

log = logging.getLogger(__name__)

# After decode failed a request, how long prefill may take to refuse it with a better reason (a
# prefill refuses what it cannot take at once; one still waiting for a handshake is cancelled).
EXPLAIN_WAIT_S = 0.5
# The body limit before any worker has said its context (`--max-body-bytes` 0): a 128k-token model.
FALLBACK_CONTEXT = 131072
NO_PAIR = "No healthy prefill/decode pair is available; retry later."
# The pause before a request's first retry on another pair; each further retry waits twice as long.
RETRY_BACKOFF_S = 0.05


class Router:
    def __init__(
        self,
        pool: WorkerPool,
        model_name: str,
        retries: int = 2,
        request_timeout_s: float = 600.0,
        verifier: PairVerifier | None = None,
        auth: RouterAuth | None = None,
        max_body_bytes: int = 0,
        prompts: PromptTokens | None = None,
        migration_limit: int = 0,
        stall_s: float | None = None,
        stall_hold_s: float = 60.0,
        client_write_timeout_s: float | None = None,
        tracer: Tracer | None = None,
        session: aiohttp.ClientSession | None = None,
        decode_headers: Mapping[str, str] = MappingProxyType({}),
    ):
        """`session`: the one its legs go out on, for a router that is not started (one in front of a decode
        instance's static pair, `decode_handoff.py`); `decode_headers`: added to every decode leg."""
        self.pool = pool
        self.tracer = tracer  # with tracing on: each attempt's spans (`hops.py`)
        self.prompts = prompts  # the cache-aware policy's tokenizer
        self.model_name = model_name
        self.retries = retries
        self.auth = auth or RouterAuth()
        pool.kv_index.key_id = self.auth.kv_key_id  # the workers' names of cached pages are keyed like the router's
        self.request_timeout_s = request_timeout_s
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=5)
        self.max_body_bytes = max_body_bytes
        # A streamed choice whose decode fails goes on on another pair this many times (`migrate.py`); a stream
        # that sends nothing for `stall_s` counts as failed (None: only the request timeout ends it), and its decode,
        # if silent on all its streams, is held out of rotation for `stall_hold_s` (`stall.py`).
        self.migration_limit = migration_limit
        self.stall_s = stall_s
        self.stall_hold_s = stall_hold_s
        # A client whose stream takes no bytes for this long is disconnected, its choices aborted (`stream.py`).
        self.client_write_timeout_s = client_write_timeout_s
        # Decode streams open now; a drain that times out closes them (`cut`).
        self.opened: set[Opened] = set()
        self.cut_reason = ""
        self._session = session
        self.decode_headers = decode_headers
        # With a verifier, requests go only to verified same-revision pairs (router/verify.py).
        self.verifier = verifier
        self.had_pair = False  # without a verifier: latched by `has_pair`

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
        if self.verifier is not None:
            self._verify = asyncio.create_task(self.verifier.run(self.session))

    async def stop(self) -> None:
        self._watch.cancel()
        if self.verifier is not None:
            self._verify.cancel()
        await self.session.close()

    def pick_pair(self, exclude: set[Worker], prompt: Prompt | None = None) -> tuple[Worker | None, Worker] | None:
        if self.verifier is not None:
            return self.verifier.pick_pair(exclude, prompt)
        return self.pool.pick_pair(exclude, prompt)

    def prompt_of(self, path: str, body: dict[str, Any]) -> Prompt | None:
        """The prompt as the cache-aware policy scores it: None without a tokenizer, before any worker's page
        size is known, or for a body the router does not read (then routed by load)."""
        return prompt_of(self.prompts, self.pool.kv_index, self.auth.kv_key, path, body)

    def body_limit(self) -> int:
        """--max-body-bytes, else the limit of the largest context a worker reported (`request/limits.py`)."""
        if self.max_body_bytes > 0:
            return self.max_body_bytes
        known = [w.max_model_len for w in self.pool.workers() if w.max_model_len]
        return body_limit_bytes(max(known) if known else FALLBACK_CONTEXT)

    # ---- one choice -----------------------------------------------------------------------
    async def open(
        self,
        path: str,
        body: SharedBody,
        choice: dict[str, Any],
        prompt: Prompt | None = None,
        avoid: set[Worker] | None = None,
    ) -> Opened:
        """Find a pair that starts answering choice `choice` (its n and seed) of `body` (whose `prompt` the
        cache-aware policy scores, when the router read it), `avoid`'s workers and those lacking its LoRA adapter
        left out."""
        tried: set[Worker] = set(avoid or ()) | self.pool.lacking(body.model)
        last: Attempt | None = None
        for attempt in range(self.retries + 1):
            if last is not None:  # a retry, after a pause that doubles: failures do not become a burst of retries
                self.pool.retries[last.worker.role if last.worker is not None else "pair"] += 1
                await asyncio.sleep(RETRY_BACKOFF_S * 2 ** (attempt - 1))
            # LoRA affinity first: an instance holding the adapter resident, when one is about as free.
            cold = self.pool.cold(body.model, tried)
            pair = (cold and self.pick_pair(tried | cold, prompt)) or self.pick_pair(tried, prompt)
            if pair is None or self.cut_reason:
                break
            p, d = pair
            self.pool.routes["pd" if p is not None else "decode_only"] += 1
            hop = self._hop(attempt, p, d, choice)
            try:
                if p is None:
                    opened = await self._try_decode_only(path, body, choice, d, prompt, hop)
                else:
                    opened = await self._try_pair(path, body, choice, p, d, prompt, hop)
            except BaseException:  # the client left
                hop.end("the client left")
                raise
            if isinstance(opened, Opened):
                return self._track(opened)
            hop.end(f"the attempt failed ({opened.status})", opened.status)
            last = opened
            if opened.code == INSTANCE_FAILED:
                self.pool.failed_instances += 1
                log.warning("a request was held by %s when it failed: not retried elsewhere", opened.worker)
            if not opened.retryable:
                break
            # Retry without the side that failed: with one prefill, a dead decode is still replaced.
            tried.update([opened.worker] if opened.worker is not None else [w for w in pair if w is not None])
        if self.cut_reason:
            raise unavailable(self.cut_reason)
        if last is None:
            raise unavailable(self.no_pair(), retry_after=RETRY_AFTER_S)
        raise last.error()

    def _hop(self, attempt: int, p: Worker | None, d: Worker, choice: dict[str, Any]) -> Hop:
        """With tracing on, the spans of this attempt (`NO_HOP`, which records nothing: off, or a request that is
        not sampled)."""
        if self.tracer is None or self.tracer.current() is None:
            return NO_HOP
        return Hop(self.tracer, attempt, p, d, len(choice.get("resume_token_ids", ())))

    def has_pair(self) -> bool:
        """A pair can take a request now: verified (without verification: a healthy prefill and decode)."""
        if self.verifier is not None:
            return self.verifier.ready()
        ok = self.pool.pick("prefill") is not None and self.pool.pick("decode") is not None
        self.had_pair = self.had_pair or ok
        return ok

    def takes_requests(self) -> bool:
        """Readiness: true once a pair has been verified (without verification: seen healthy). A new replica
        stays out of the Service until then (a rollout keeps the old one), but once in, a router keeps its place
        through gaps without a pair (a rollout's revision change, a decode restarting) and answers 503 +
        Retry-After naming why: every router sees the same workers, so leaving the Service would only turn that
        clear refusal into a refused or unanswered connection."""
        if self.verifier is not None:
            return self.verifier.verified_once
        return self.has_pair() or self.had_pair

    def no_pair(self) -> str:
        """The 503 message when no pair can take a request; why none is verified goes to the log (it names workers)."""
        if self.verifier is not None:
            self.verifier.log_unready()
        return NO_PAIR

    def _track(self, o: Opened) -> Opened:
        if self.cut_reason:  # the drain ended while this pair opened
            self.close(o)
            raise unavailable(self.cut_reason)
        self.opened.add(o)
        return o

    def close(self, o: Opened, error: str = "") -> None:
        """The client's answer is complete or abandoned (or its decode failed: `error`): give decode's response
        back."""
        o.hop.end(error)
        o.resp.release()
        self.opened.discard(o)
        o.decode.give_back(o.decode_group)

    def cut(self, reason: str) -> int:
        """End every open stream now (their clients get an error event naming `reason`); returns how many."""
        self.cut_reason = reason
        for o in list(self.opened):
            o.resp.close()
            if o.prefill is not None:
                o.prefill.cancel()
        return len(self.opened)

    async def _try_pair(
        self,
        path: str,
        body: SharedBody,
        choice: dict,
        p: Worker,
        d: Worker,
        prompt: Prompt | None = None,
        hop: Hop = NO_HOP,
    ) -> Opened | Attempt:
        room_id = secrets.randbits(63)
        # DP attention: the attention groups each side runs the request on (None: a side runs one group).
        (pg, uncached), (dg, _) = self.pool.group_for(p, room_id, prompt), self.pool.group_for(d, room_id, prompt)
        room = self.auth.target(p.host, p.bootstrap_port, room_id, pg)
        # Prefill answers with one token, never streamed (stream_options is only valid on a stream).
        prefill_body = body.payload(**choice, **room, **route.group_fields(pg), stream=False, stream_options=None)
        # Counted before the task starts, so that picks made meanwhile (the other choices of an n > 1 request, a
        # burst) see it; given back when the task ends, even one cancelled before it ran.
        p.add_tokens(uncached, pg)
        prefill = asyncio.create_task(self._prefill(p, path, prefill_body, pg, hop))
        prefill.add_done_callback(lambda _: p.release_tokens(uncached, pg))
        decode = asyncio.create_task(
            self._decode(d, path, body.payload(**choice, **room, **route.group_fields(dg)), dg, hop)
        )
        try:
            await asyncio.wait((prefill, decode), return_when=asyncio.FIRST_COMPLETED)
            if not decode.done() and prefill.result().status != 200:
                decode.cancel()  # prefill refused: decode would wait for KV that never comes
                await asyncio.gather(decode, return_exceptions=True)
                return prefill.result()
            opened = await decode
        except BaseException:  # the client left: abort both sides
            prefill.cancel()
            decode.cancel()
            raise
        if isinstance(opened, Attempt):
            return await self._explain(opened, prefill)
        if self.verifier is not None:
            self.verifier.passed(p, d)
        return Opened(opened[0], opened[1], prefill, d, dg, hop)

    async def _try_decode_only(
        self, path: str, body: SharedBody, choice: dict, d: Worker, prompt: Prompt | None, hop: Hop = NO_HOP
    ) -> Opened | Attempt:
        """Conditional disaggregation: decode computes the prompt itself (`local_prefill`), no prefill involved."""
        dg, _ = self.pool.group_for(d, secrets.randbits(63), prompt, local=True)
        opened = await self._decode(
            d, path, body.payload(**choice, **self.auth.local_prefill(), **route.group_fields(dg)), dg, hop
        )
        return opened if isinstance(opened, Attempt) else Opened(opened[0], opened[1], None, d, dg, hop)

    async def _decode(
        self, d: Worker, path: str, payload: JoinedPayload, group: int | None = None, hop: Hop = NO_HOP
    ) -> tuple[aiohttp.ClientResponse, bytes] | Attempt:
        """Decode's response and its first event; or what went wrong (decode's in-flight count then restored)."""
        d.take(group)
        resp: aiohttp.ClientResponse | None = None
        headers = {**self.decode_headers, **hop.decode_headers}
        try:
            resp = await self.session.post(f"{d.url}{path}", data=payload, timeout=self.timeout, headers=headers)
            first = await first_event(resp) if resp.status == 200 else await resp.read()
            attempt = error_in(resp.status, first)
            if attempt is None:
                return resp, first
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            log.warning("decode %s failed before answering: %r", d.url, e)
            d.failures += 1
            attempt = Attempt(502, APIError(502, lost("decode", e).message, type="server_error").body())
        except BaseException:
            d.give_back(group)
            if resp is not None:
                resp.close()
            raise
        d.give_back(group)
        if resp is not None:
            resp.release()
        attempt.worker = d
        self._note(d, attempt)
        return attempt

    async def _prefill(
        self, p: Worker, path: str, payload: JoinedPayload, group: int | None = None, hop: Hop = NO_HOP
    ) -> Attempt:
        p.take(group)
        headers = hop.prefill_headers
        attempt: Attempt | None = None
        try:
            async with self.session.post(f"{p.url}{path}", data=payload, timeout=self.timeout, headers=headers) as r:
                attempt = Attempt(r.status, json_or_error(r.status, await r.read()))
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            log.warning("prefill %s failed: %r", p.url, e)
            p.failures += 1
            attempt = Attempt(502, APIError(502, lost("prefill", e).message, type="server_error").body())
        finally:
            p.give_back(group)
            # 499: cancelled (the client left, or decode failed first)
            hop.prefill_answered(attempt.status if attempt is not None else 499)
        attempt.worker = p
        self._note(p, attempt)
        return attempt

    @staticmethod
    def _note(w: Worker, attempt: Attempt) -> None:
        """A worker that says it drains is not picked again until its /health is 200."""
        if attempt.status == 503 and attempt.code == DRAINING and w.healthy:
            log.info("%s worker %s is draining: not picked until its /health is 200", w.role, w.url)
            w.healthy = False

    @staticmethod
    async def _explain(decode_error: Attempt, prefill: asyncio.Task) -> Attempt:
        """A prefill that refused the request explains a decode failure better than decode can.

        A decode that refused to start (429, 503) did no work prefill could explain: prefill's half
        is cancelled at once."""
        if decode_error.status in (429, 503):
            prefill.cancel()
            return decode_error
        try:
            p = await asyncio.wait_for(asyncio.shield(prefill), timeout=EXPLAIN_WAIT_S)
        except asyncio.TimeoutError:
            prefill.cancel()
            return decode_error
        if 400 <= p.status < 500:
            return p
        return decode_error


ROUTER = web.AppKey("router", Router)
