"""The grammar compiler's queue: bounded, and a request that leaves takes its queued compilation with it."""

from __future__ import annotations

import dataclasses
import json
import threading

from disagg_worker.engine.grammar import GRAMMAR_THREADS, Grammars
from disagg_worker.engine.grammar_wait import GrammarWait
from disagg_worker.request import messages as msg
from disagg_worker.request.params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0)


def regex(i: int) -> str:
    return json.dumps({"pattern": f"a{{{i}}}", "type": "regex"})


def held_grammars(queue_entries: int) -> tuple[Grammars, threading.Event, list[str]]:
    """Grammars whose compilations block until the event is set, recording which ones ran."""
    grammars = Grammars("unused", 32, [1], queue_entries=queue_entries)
    release, ran = threading.Event(), []

    def compiled(grammar: str) -> object:
        ran.append(grammar)
        release.wait(30)
        raise ValueError(f"compiled {grammar}")  # a 400 naming it: which grammar ran is what is under test

    grammars.compiled = compiled  # type: ignore[method-assign] # the compiler itself is not under test
    return grammars, release, ran


def request(rid: str, grammar: str) -> msg.GenerateReq:
    return msg.GenerateReq(rid, [5, 6, 7], dataclasses.replace(GREEDY, grammar=grammar))


def test_a_request_that_leaves_takes_its_queued_compilation_with_it():
    grammars, release, ran = held_grammars(queue_entries=16)
    wait = GrammarWait(grammars, limit_s=30)
    try:
        for i in range(GRAMMAR_THREADS):  # every thread busy
            wait.add(request(f"busy{i}", regex(i)))
        wait.add(request("queued", regex(99)))
        wait.add(request("shared-a", regex(98)))
        wait.add(request("shared-b", regex(98)))
        queued = wait.waiting["queued"].compiled
        assert wait.abort("queued") and queued.cancelled()
        assert wait.abort("shared-a") and not wait.waiting["shared-b"].compiled.cancelled(), "b still waits for it"
        release.set()
        ready = {r.m.rid: r for r in _poll_all(wait)}
        assert {rid: r.problem for rid, r in ready.items()} == {
            "busy0": f"compiled {regex(0)}",
            "busy1": f"compiled {regex(1)}",
            "shared-b": f"compiled {regex(98)}",
        }
        assert regex(99) not in ran and regex(98) in ran
    finally:
        release.set()
        grammars.close()


def test_a_full_queue_refuses_a_new_grammar_at_once_with_a_503_and_holds_nothing_against_it():
    grammars, release, _ = held_grammars(queue_entries=3)
    wait = GrammarWait(grammars, limit_s=30)
    try:
        for i in range(3):
            wait.add(request(f"r{i}", regex(i)))
        wait.add(request("over", regex(50)))
        refused = [r for r in wait.poll() if r.m.rid == "over"]
        assert len(refused) == 1 and refused[0].status == 503 and "busy" in refused[0].problem
        wait.add(request("same-as-queued", regex(2)))  # a grammar already queued joins it: not refused
        assert [r for r in wait.poll() if r.m.rid == "same-as-queued"] == []
        release.set()
        _poll_all(wait)
        wait.add(request("later", regex(50)))  # once there is room, the refused grammar compiles
        assert [r.problem for r in _poll_all(wait) if r.m.rid == "later"] == [f"compiled {regex(50)}"]
    finally:
        release.set()
        grammars.close()


def _poll_all(wait: GrammarWait, timeout_s: float = 30.0) -> list:
    import time

    out, deadline = [], time.monotonic() + timeout_s
    while wait.waiting and time.monotonic() < deadline:
        out += wait.poll()
        time.sleep(0.01)
    return out + wait.poll()
