"""Requests waiting for their grammar before they enter a queue.

A request with a grammar is held here while the grammar thread compiles it (`Grammars.submit`), so a slow
schema never stalls the steps of the others. `poll` hands back each request whose wait is over: with its
matcher; refused (400) when its grammar does not compile or did not compile within the limit (that grammar
is then refused at once, `Grammars.give_up`); or failed alone (500) when the compiler raised anything else.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from disagg_worker.engine.grammar import Grammars
from disagg_worker.messages import GenerateReq

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Waiting:
    m: GenerateReq
    matcher: Future
    deadline: float  # time.monotonic()


@dataclass(frozen=True)
class Ready:
    """A request whose wait is over: `matcher` when compiled; else `problem` (a 400's message), or `failed`."""

    m: GenerateReq
    matcher: Any = None
    problem: str = ""
    failed: bool = False


class GrammarWait:
    def __init__(self, grammars: Grammars, limit_s: float):
        self.grammars = grammars
        self.limit_s = limit_s
        self.waiting: dict[str, Waiting] = {}
        # Called from the grammar thread when a compilation ends (the loop's wake-up).
        self.wake: Callable[[], None] = lambda: None

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, m: GenerateReq) -> None:
        grammar = m.params.grammar
        if grammar is None:
            raise ValueError("a request without a grammar does not wait for one")
        matcher = self.grammars.submit(grammar)
        matcher.add_done_callback(lambda _: self.wake())
        self.waiting[m.rid] = Waiting(m, matcher, time.monotonic() + self.limit_s)

    def abort(self, rid: str) -> bool:
        return self.waiting.pop(rid, None) is not None

    def poll(self) -> list[Ready]:
        now, ready = time.monotonic(), []
        for rid, w in list(self.waiting.items()):
            if w.matcher.done() or now >= w.deadline:
                del self.waiting[rid]
                ready.append(self._outcome(w))
        return ready

    def _outcome(self, w: Waiting) -> Ready:
        if not w.matcher.done():
            return Ready(w.m, problem=self.grammars.give_up(w.m.params.grammar or ""))
        error = w.matcher.exception()
        if error is None:
            return Ready(w.m, matcher=w.matcher.result())
        if isinstance(error, ValueError):
            return Ready(w.m, problem=str(error))
        log.error("request %s: compiling its grammar failed", w.m.rid, exc_info=error)
        return Ready(w.m, failed=True)
