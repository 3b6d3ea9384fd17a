"""Requests waiting for their grammar before they enter a queue.

A request with a grammar is held here while a grammar thread compiles it (`Grammars.submit`), so a slow
schema never stalls the steps of the others. `poll` hands back each request whose wait is over: with its
matcher; refused (400) when its grammar does not compile, or when its compilation has run past the limit
(that grammar is then refused at once, `Grammars.give_up`); refused with a 503 (retry later, nothing
remembered against the grammar) when it waited for a thread past QUEUED_LIMITS times the limit behind slow
ones, or at once when the compiler's queue is full (`Grammars.queue_entries`); or failed alone (500) when the
compiler raised anything else. A request that leaves (aborted, or refused) takes its grammar's compilation
with it when that has not started and no other request waits for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from disagg_worker.engine.grammar import CompilerBusy, Grammars, new_matcher
from disagg_worker.request.messages import GenerateReq

log = logging.getLogger(__name__)
# A request waits at most this many times the compile limit in all (queued behind other compilations included).
QUEUED_LIMITS = 3


@dataclass(frozen=True)
class Waiting:
    m: GenerateReq
    compiled: Future
    since: float  # time.monotonic()


@dataclass(frozen=True)
class Ready:
    """A request whose wait is over: `matcher` when compiled; else `problem` with its `status`, or `failed`."""

    m: GenerateReq
    matcher: Any = None
    problem: str = ""
    status: int = 400
    failed: bool = False


class GrammarWait:
    def __init__(self, grammars: Grammars, limit_s: float):
        self.grammars = grammars
        self.limit_s = limit_s
        self.waiting: dict[str, Waiting] = {}
        # Called from a grammar thread when a compilation ends (the loop's wake-up).
        self.wake: Callable[[], None] = lambda: None

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, m: GenerateReq) -> None:
        grammar = m.params.grammar
        if grammar is None:
            raise ValueError("a request without a grammar does not wait for one")
        compiled = self.grammars.submit(grammar)
        compiled.add_done_callback(lambda _: self.wake())
        self.waiting[m.rid] = Waiting(m, compiled, time.monotonic())

    def abort(self, rid: str) -> bool:
        w = self.waiting.pop(rid, None)
        if w is None:
            return False
        self._left(w)
        return True

    def _left(self, w: Waiting) -> None:
        """`w` waits no more: its grammar's compilation is dropped if it has not started and no one else waits."""
        if not w.compiled.done() and all(o.compiled is not w.compiled for o in self.waiting.values()):
            self.grammars.cancel(w.m.params.grammar or "", w.compiled)

    def poll(self) -> list[Ready]:
        ready = []
        for rid, w in list(self.waiting.items()):
            outcome = self._outcome(w)
            if outcome is not None:
                del self.waiting[rid]
                self._left(w)
                ready.append(outcome)
        return ready

    def _outcome(self, w: Waiting) -> Ready | None:
        grammar = w.m.params.grammar or ""
        if not w.compiled.done():
            running = self.grammars.compiling_for(grammar)
            if running is not None and running >= self.limit_s:
                return Ready(w.m, problem=self.grammars.give_up(grammar))
            if time.monotonic() - w.since >= QUEUED_LIMITS * self.limit_s:
                return Ready(w.m, problem="the grammar compiler is busy with other grammars; retry", status=503)
            return None
        error = w.compiled.exception()
        if error is None:
            return Ready(w.m, matcher=new_matcher(w.compiled.result()))
        if isinstance(error, CompilerBusy):
            return Ready(w.m, problem=f"the grammar compiler is busy: {error}", status=503)
        if isinstance(error, ValueError):
            return Ready(w.m, problem=str(error))
        log.error("request %s: compiling its grammar failed", w.m.rid, exc_info=error)
        return Ready(w.m, failed=True)
