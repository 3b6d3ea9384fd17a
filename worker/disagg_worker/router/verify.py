"""Pair verification: the router proves every prefill->decode pair it may use before and while it uses it.

Two workers that each answer /health can still be unable to hand a request over (a prefill restarted behind the
same address, a blocked transfer port, mismatched builds). So a pair is usable only when both workers pass their
health check, report the same pairing revision (a rollout never pairs an old prefill with a new decode), and the
pair's latest verification passed; and neither may be held out (a decode whose streams all stalled, `stall.py`).
A verification is a synthetic request through the normal path: /generate on both workers with a one-token
prompt, one new token and the bootstrap fields, so decode really bootstraps with prefill and receives the KV
pages. It carries PROBE_HEADER, so workers keep it out of their user-facing request metrics.

Verified pairs are re-verified every `interval_s`; a user request that succeeds on a pair verifies it too, so a
busy pair costs no probes. A failed pair (or one whose worker fails its health check) is out of rotation and
retried after a backoff that doubles from `backoff_s` up to `backoff_max_s`. At most `max_probes` probes run at
once. `/health` is 200 only while some pair is verified and lists every pair with its last result; the router
becomes Ready (`/ready`) with its first verified pair.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import aiohttp

from disagg_worker.http.probe import PROBE_HEADER
from disagg_worker.request import route
from disagg_worker.router.auth import RouterAuth
from disagg_worker.router.handoff import HandoffMonitor
from disagg_worker.router.policies.prefix import Prompt
from disagg_worker.router.worker import GroupPolicy, Worker
from disagg_worker.router.workers import WorkerPool

log = logging.getLogger(__name__)
Pair = tuple[Worker, Worker]
PROBE_TOKEN = 0  # any id exists in every vocabulary


@dataclass
class PairState:
    verified: bool = False
    error: str = "not verified yet"
    checked_at: float | None = None  # when the latest result came (monotonic)
    failures: int = 0  # consecutive
    due: float = 0.0
    probing: bool = False


def stable(text: str, limit: int = 300) -> str:
    """An error message without the numbers that differ per request (room ids, ports), so that it reads the same
    from one failed probe to the next."""
    return re.sub(r"\d{5,}", "N", " ".join(text.split()))[:limit]


def _why(p: Worker, d: Worker, state: PairState, now: float) -> str:
    """Why a pair does not carry requests: a side that is down, draining or held out, else its last verification."""
    for w in (p, d):
        if not w.healthy:
            status = w.report.get("status")
            return f"{w.role} {w.name} is {'draining' if status == 'draining' else 'not healthy'}"
        if w.held_out(now):
            return f"{w.role} {w.name} is held out: its streams stalled"
    return state.error


def _urls(item: tuple[Worker, Worker, PairState]) -> tuple[str, str]:
    return item[0].url, item[1].url


def same_revision(p: Worker, d: Worker) -> bool:
    return p.revision == d.revision


class PairVerifier:
    def __init__(
        self,
        pool: WorkerPool,
        interval_s: float = 10.0,
        timeout_s: float = 60.0,
        backoff_s: float = 1.0,
        backoff_max_s: float = 30.0,
        max_probes: int = 4,
        monitor: HandoffMonitor | None = None,
        clock: Callable[[], float] = time.monotonic,
        auth: RouterAuth | None = None,
    ):
        self.pool = pool
        self.auth = auth or RouterAuth()  # signs each probe's bootstrap target, as for client requests
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=5)
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.max_probes = max_probes
        self.monitor = monitor or HandoffMonitor(clock=clock)
        self.clock = clock
        self.states: dict[Pair, PairState] = {}
        self.verified_once = False  # some pair has passed: the router's readiness from then on
        self.logged_reason = ""  # the last `unready_reason` logged

    # ---- which pairs may carry requests ----------------------------------------------------
    def candidates(self) -> list[Pair]:
        """Every prefill x decode combination of the same revision, healthy or not."""
        return [
            (p, d) for p in self.pool.workers("prefill") for d in self.pool.workers("decode") if same_revision(p, d)
        ]

    def usable(self, p: Worker, d: Worker) -> bool:
        """Verified, of one revision, and both sides available (healthy, not held out after a stall)."""
        state, now = self.states.get((p, d)), self.clock()
        return bool(state and state.verified and p.available(now) and d.available(now) and same_revision(p, d))

    def ready(self) -> bool:
        return any(self.usable(p, d) for p, d in self.states)

    def log_unready(self) -> None:
        """Log why no pair carries requests, once each time the reason changes: it names the workers, which a
        client's 503 does not (/health's "pairs" shows each pair's state to whoever may see it)."""
        reason = self.unready_reason()
        if reason != self.logged_reason:
            self.logged_reason = reason
            log.warning("no prefill/decode pair takes requests: %s", reason)

    def unready_reason(self) -> str:
        """Why no pair carries requests: the last result of each pair that is not usable (a few)."""
        failing = sorted(((p, d, s) for (p, d), s in self.states.items() if not self.usable(p, d)), key=_urls)
        if not failing:
            return "no prefill and decode instance of one revision has been seen healthy"
        now = self.clock()
        named = [f"{p.name} -> {d.name}: {_why(p, d, s, now)}" for p, d, s in failing[:3]]
        return "; ".join(named) + (f"; and {len(failing) - 3} more" if len(failing) > 3 else "")

    def pick_pair(
        self, exclude: frozenset[Worker] | set[Worker] = frozenset(), prompt: Prompt | None = None
    ) -> tuple[Worker | None, Worker] | None:
        """A verified pair, each side chosen by the pool's policy among the verified partners of the other; (None,
        decode) when that decode computes the prompt itself (`WorkerPool.decode_only`)."""
        usable = [(p, d) for p, d in self.states if self.usable(p, d) and p not in exclude and d not in exclude]
        decodes = {d for _, d in usable}
        d = self.pool.pick("decode", set(exclude) | (set(self.pool.workers("decode")) - decodes), prompt)
        if d is None:
            return None
        if self.pool.decode_only(d, prompt):
            return None, d
        partners = {p for p, dd in usable if dd is d}
        p = self.pool.pick("prefill", set(exclude) | (set(self.pool.workers("prefill")) - partners), prompt)
        return (p, d) if p is not None else None

    def passed(self, p: Worker, d: Worker) -> None:
        """A user request went through this pair: as good as a probe."""
        self._record((p, d), "")

    # ---- bookkeeping -----------------------------------------------------------------------
    def _record(self, pair: Pair, error: str) -> None:
        state = self.states.setdefault(pair, PairState())
        now = self.clock()
        if error and state.verified:
            log.warning("pair %s -> %s failed verification: %s", pair[0].url, pair[1].url, error)
        elif not error and not state.verified:
            log.info("pair %s -> %s verified", pair[0].url, pair[1].url)
        state.verified, state.error, state.checked_at = not error, error, now
        self.verified_once = self.verified_once or not error
        state.failures = state.failures + 1 if error else 0
        delay = min(self.backoff_s * 2 ** (state.failures - 1), self.backoff_max_s) if error else self.interval_s
        state.due = now + delay

    def refresh(self) -> list[Pair]:
        """Track the current pairs, fail those with an unhealthy worker, and return the pairs due for a probe."""
        current = set(self.candidates())
        for pair in [pair for pair in self.states if pair not in current]:
            del self.states[pair]
        now = self.clock()
        due = []
        for pair in current:
            state = self.states.setdefault(pair, PairState())
            sick = [w for w in pair if not w.healthy]
            if sick:
                if state.verified or state.checked_at is None:
                    self._record(pair, f"{sick[0].role} {sick[0].name} fails its health check")
                state.due = now  # probe as soon as it is healthy again
            elif not state.probing and state.due <= now:
                due.append(pair)
        running = sum(s.probing for s in self.states.values())
        due.sort(key=lambda pair: self.states[pair].due)
        return due[: max(0, self.max_probes - running)]

    # ---- probing ---------------------------------------------------------------------------
    async def probe(self, session: aiohttp.ClientSession, p: Worker, d: Worker) -> str:
        """One synthetic request through the pair: "" when decode produced its token, else why not. With DP
        attention a probe runs in the attention groups its room picks (`room % dp_size`), so probes visit
        every group in turn."""
        room = secrets.randbits(63)
        pg, dg = p.pick_group(GroupPolicy.ROOM, room), d.pick_group(GroupPolicy.ROOM, room)
        body = {
            # One token: shorter than a page, so the prefix cache neither skips the work nor keeps anything.
            "input_ids": [PROBE_TOKEN],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            **self.auth.target(p.host, p.bootstrap_port, room, pg),
            "stream": False,
        }
        to_p = asyncio.create_task(self._post(session, p, {**body, **route.group_fields(pg)}))
        to_d = asyncio.create_task(self._post(session, d, {**body, **route.group_fields(dg)}))
        await asyncio.wait((to_p, to_d), return_when=asyncio.FIRST_COMPLETED)
        if to_d.done() and to_d.result()[0] != 200 and not to_p.done():
            # Decode refused (a handshake mismatch, say): prefill would only wait out its bootstrap timeout.
            to_p.cancel()
            await asyncio.gather(to_p, return_exceptions=True)
            return stable(f"decode {to_d.result()[1]}")
        (p_status, p_answer), (d_status, d_answer) = await asyncio.gather(to_p, to_d)
        # Decode meets a handshake refusal first-hand; prefill's failure is then its consequence (a
        # bootstrap timeout), unless prefill refused the request itself.
        if 400 <= p_status < 500:
            return stable(f"prefill {p_answer}")
        if d_status != 200:
            return stable(f"decode {d_answer}")
        if p_status != 200:
            return stable(f"prefill {p_answer}")
        if not d_answer:
            return "decode answered without a token"
        return ""

    async def _post(self, session: aiohttp.ClientSession, w: Worker, body: dict) -> tuple[int, str]:
        """(status, error or the decoded token count as text); status 0 when there was no HTTP answer."""
        try:
            async with session.post(
                f"{w.url}/generate", json=body, headers={PROBE_HEADER: "1"}, timeout=self.timeout
            ) as r:
                data = await r.json(content_type=None)
                if r.status != 200:
                    message = data.get("error", {}).get("message", "") if isinstance(data, dict) else ""
                    return r.status, f"HTTP {r.status}: {message}"
                return 200, "1" if isinstance(data, dict) and data.get("output_ids") else ""
        except asyncio.TimeoutError:
            return 0, f"gave no answer within {self.timeout.total:g}s"
        except (aiohttp.ClientError, ValueError) as e:
            return 0, f"unreachable: {type(e).__name__}"

    async def _verify(self, session: aiohttp.ClientSession, pair: Pair) -> None:
        state = self.states.setdefault(pair, PairState())
        state.probing = True
        try:
            self._record(pair, await self.probe(session, *pair))
        finally:
            state.probing = False

    async def run(self, session: aiohttp.ClientSession, tick_s: float = 0.5) -> None:
        """Until cancelled: start the probes that are due, feed the handoff monitor."""
        tasks: set[asyncio.Task] = set()
        while True:
            try:
                for pair in self.refresh():
                    task = asyncio.create_task(self._verify(session, pair))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                self.monitor.observe(self.pool.workers())
            except Exception:  # one bad round must not stop verification
                log.exception("pair verification round failed")
            await asyncio.sleep(tick_s)

    # ---- reporting -------------------------------------------------------------------------
    def describe(self, pairs: Iterable[Pair] | None = None) -> list[dict]:
        now = self.clock()
        out = []
        for p, d in sorted(pairs or self.states, key=lambda pair: (pair[0].url, pair[1].url)):
            state = self.states.get((p, d), PairState())
            out.append(
                {
                    "prefill": p.name,
                    "decode": d.name,
                    "revision": p.revision,
                    "verified": self.usable(p, d),
                    "error": "" if self.usable(p, d) else state.error,
                    "age_s": None if state.checked_at is None else round(now - state.checked_at, 1),
                }
            )
        return out
