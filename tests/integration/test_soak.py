"""The P/D soak: disaggregation changes where the work runs, never the answer.

A P/D stack started piece by piece (two prefills, two decodes, a router) serves many concurrent streaming
clients, greedy and seeded, over prompts of many lengths, without `ignore_eos` (answers end on EOS as well as
on the length: a request that ends while the next decode step is already in flight is the case
`engine/in_flight.py` guards). Every answer is compared with the monolithic server's for the same prompt and
parameters: quiet, then while each kind of instance is killed with SIGKILL and started again on its ports.

Its size (`SOAK_SECONDS` per phase, `SOAK_CLIENTS`) fits `make test`; `make test-stress` runs it longer.
"""

from __future__ import annotations

import collections
import json
import os
import random
import threading
import time
from dataclasses import dataclass, field

import pytest
import requests

from tests.integration.procs import PDStack, idle_now, scaled, serve, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.soak]
SECONDS = float(os.environ.get("SOAK_SECONDS", "25"))
CLIENTS = int(os.environ.get("SOAK_CLIENTS", "12"))
WORDS = "the of river stone light over seven quiet houses and a bridge under old rain".split()
PROMPTS = [" ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(1 + (i * 7) % 60)) for i in range(24)]
# (prompt, sampling): greedy for every prompt, seeded sampling for every third.
CASES = [(p, {"temperature": 0}) for p in PROMPTS] + [
    (p, {"temperature": 0.9, "top_p": 0.95, "seed": 1000 + i}) for i, p in enumerate(PROMPTS) if i % 3 == 0
]
MAX_TOKENS = 40


def body(case: int) -> dict:
    prompt, sampling = CASES[case]
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, **sampling}


def answer(url: str, case: int) -> tuple[str, str]:
    """("ok", text), ("error", status and message) or ("hung", why) of one streamed completion."""
    try:
        r = requests.post(f"{url}/v1/completions", json={**body(case), "stream": True}, stream=True, timeout=scaled(60))
        if r.status_code != 200:
            return "error", f"{r.status_code} {r.text[:200]}"
        text = []
        for line in r.iter_lines(decode_unicode=True):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return "error", str(event["error"])[:200]
            text.append(event["choices"][0]["text"])
        return "ok", "".join(text)
    except requests.Timeout as e:
        return "hung", str(e)
    except requests.ConnectionError as e:  # the router itself was killed
        return "error", str(e)[:200]


@dataclass
class Soak:
    """Clients sending random cases until `stop`; what came back, counted against the references."""

    url: str
    references: dict[int, str]
    counts: collections.Counter = field(default_factory=collections.Counter)
    differ: list[tuple[str, str, str]] = field(default_factory=list)  # (prompt, monolithic's, P/D's)
    failures: list[tuple[str, str]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            case = rng.randrange(len(CASES))
            kind, text = answer(self.url, case)
            self.counts[kind] += 1
            if kind != "ok":
                self.failures.append((kind, text))
            elif text != self.references[case]:
                self.differ.append((CASES[case][0], self.references[case], text))

    def run(self, seconds: float, during=lambda: None) -> Soak:
        threads = [threading.Thread(target=self.client, args=(k,), daemon=True) for k in range(CLIENTS)]
        for t in threads:
            t.start()
        end = time.monotonic() + seconds
        during()
        time.sleep(max(0.0, end - time.monotonic()))
        self.stop.set()
        for t in threads:
            t.join(scaled(90))
        assert not any(t.is_alive() for t in threads), "a client never came back"
        return self


@pytest.fixture(scope="module")
def references(tiny_model) -> dict[int, str]:
    """The monolithic server's answer to every case, one at a time."""
    mono = serve(tiny_model, "--served-model-name", "tiny").wait_healthy()
    try:
        out = {}
        for case in range(len(CASES)):
            r = requests.post(f"{mono.url}/v1/completions", json=body(case), timeout=scaled(60))
            assert r.status_code == 200, r.text
            out[case] = r.json()["choices"][0]["text"]
        return out
    finally:
        mono.stop()


@pytest.fixture(scope="module")
def stack(tiny_model):
    s = PDStack(tiny_model, prefills=2, decodes=2).wait_healthy()
    yield s
    s.stop()


def workers(stack: PDStack):
    return [*stack.prefills, *stack.decodes]


def assert_no_page_taken_in_flight(stack: PDStack) -> None:
    """The rule of `engine/in_flight.py`, as each instance counts it: no page was taken while a step wrote it."""
    for w in workers(stack):
        st = idle_now(w.url)
        assert st["pages_taken_in_flight"] == 0, (w.url, st["pages_taken_in_flight"])


def test_quiet_pd_answers_are_the_monolithic_ones(stack, references):
    soak = Soak(stack.router.url, references).run(SECONDS)
    print(f"soak, quiet: {dict(soak.counts)}, {len(soak.differ)} differ")
    assert soak.counts["ok"] >= CLIENTS and not soak.failures, soak.failures[:3]
    assert soak.differ == [], soak.differ[:3]
    assert_no_page_taken_in_flight(stack)


def test_pd_answers_are_the_monolithic_ones_while_instances_are_killed(stack, references):
    """SIGKILL of a prefill, then of a decode, each started again on its ports once it is gone: what fails is
    a 5xx or an error event, nothing hangs, and every answer that completes is the monolithic one."""

    def kill_each() -> None:
        for role, i in (("prefill", 0), ("decode", 1)):
            procs = stack.prefills if role == "prefill" else stack.decodes
            wait_until(lambda: soak.counts["ok"] > 0, 30, what="answers flowing")
            old = procs[i]
            old.kill()
            old.wait_exit(30)
            if role == "prefill":
                procs[i] = stack.start_prefill(old.port, stack.bootstrap_ports[i]).wait_healthy()
            else:
                procs[i] = stack.start_decode(old.port).wait_healthy()
            wait_until(lambda: router_sees(stack, procs[i].url), 60, what=f"router sees the new {role}")  # noqa: B023

    soak = Soak(stack.router.url, references)
    soak.run(SECONDS, during=kill_each)
    print(f"soak, kill -9: {dict(soak.counts)}, {len(soak.differ)} differ")
    assert soak.counts["hung"] == 0, soak.failures[:3]
    assert all(kind == "error" for kind, _ in soak.failures)
    assert soak.counts["ok"] >= CLIENTS
    assert soak.differ == [], soak.differ[:3]
    assert_no_page_taken_in_flight(stack)


def router_sees(stack: PDStack, url: str) -> bool:
    """Whether the router's /health lists `url` as a healthy worker."""
    r = requests.get(f"{stack.router.url}/health", timeout=scaled(5))
    return any(w["url"] == url and w["healthy"] for w in r.json().get("workers", []))
