"""A stream survives the loss of the decode serving it: the router migrates it to another pair, and the client
reads the answer an uninterrupted run gives, with one [DONE] and the same usage. And a client that leaves before
its first token frees both legs at once.

One prefill and two decodes (X and Y) behind a router. Only one decode runs when the streams start, so that
all eight are on it; once every stream has passed its tenth token the decode is frozen (its streams can neither
go on nor end), the other one is started, and the frozen one is killed with SIGKILL: each stream must go on on
the other pair from where it was. Greedy, seeded and JSON-schema answers are compared with an uninterrupted run
of the same requests on the same stack; and greedy and seeded answers again on a stack whose decodes speculate
(NGRAM).
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import time

import aiohttp
import pytest
import requests

from tests.integration.procs import PDStack, Stream, idle, report_after, scaled, wait_until

pytestmark = pytest.mark.integration
STREAMS = 8
MAX_TOKENS = 800  # long enough that no stream ends before the slowest one has started
KILL_AFTER_EVENTS = 10
WORDS = {
    "type": "object",
    "properties": {"words": {"type": "array", "items": {"type": "string"}, "minItems": 40}},
    "required": ["words"],
}
KINDS = {
    "greedy": {"temperature": 0, "ignore_eos": True},
    "seeded": {"temperature": 1.0, "top_p": 0.95, "ignore_eos": True},
    "schema": {
        "temperature": 1.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "words", "schema": WORDS}},
    },
}


FLAGS = ("--page-size", "16", "--chunk-size", "64", "--max-total-tokens", str(STREAMS * 2 * (MAX_TOKENS + 100)))
NGRAM = ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5")


def start_on_one_decode(tiny_model: str, decode_flags: tuple[str, ...] = ()) -> PDStack:
    s = PDStack(tiny_model, *FLAGS, decodes=2, decode_flags=decode_flags, router_flags=("--verify-interval", "0"))
    s.wait_healthy()
    s.decodes[1].kill()  # the first run starts on decode X alone
    wait_until(lambda: not healthy(s, s.decodes[1].url), what="the router sees decode Y gone")
    return s


@pytest.fixture(scope="module")
def stack(tiny_model):
    s = start_on_one_decode(tiny_model)
    yield s
    s.stop()


def stats(url: str) -> dict:
    return requests.get(f"{url}/stats", timeout=scaled(5)).json()


def test_clients_that_leave_before_their_first_token_free_both_legs_at_once(stack):
    """Eight long prompts: prefill computes them one after another while decode holds pages for them. Once both
    sides hold some, every client leaves: within 1.5 s (scaled) prefill holds nothing and decode no page. The
    scheduler reports every 0.5 s, which bounds what this can see: on a quiet 2-core machine the first report
    made 0.5 s after the leave already shows both sides clear."""
    decode = next(d for d in stack.decodes if d.proc.poll() is None)
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 2000) for _ in range(3000)] for _ in range(STREAMS)]

    async def leave_early() -> float:
        async with aiohttp.ClientSession() as session:
            url = f"{stack.router.url}/v1/completions"
            calls = [asyncio.create_task(session.post(url, json={"prompt": p, "max_tokens": 50})) for p in prompts]
            deadline = time.monotonic() + scaled(60)
            while not (busy(stats(stack.prefill.url)) and stats(decode.url).get("pages_used", 0) > 0):
                assert time.monotonic() < deadline and not any(c.done() for c in calls), "no leg held the requests"
                await asyncio.sleep(0.02)
            left = time.time()
            for c in calls:
                c.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            return left

    left = asyncio.run(leave_early())
    bound = scaled(1.5)
    freed = report_after(decode.url, left, lambda st: idle(st) and st["pages_used"] == 0, bound, "every page free")
    cleared = report_after(stack.prefill.url, left, idle, bound, "nothing held")
    print(f"after the clients left: decode freed {freed['time'] - left:.2f} s, prefill {cleared['time'] - left:.2f} s")


def busy(st: dict) -> bool:
    """Whether a report shows prefill computing (an instance whose scheduler has not reported yet is not)."""
    return bool(st.get("queues", {}).get("prefill_forward") or st.get("running"))


def healthy(stack: PDStack, url: str) -> bool:
    """Whether the router takes the worker at `url` for healthy."""
    workers = requests.get(f"{stack.router.url}/health", timeout=scaled(5)).json()["workers"]
    return any(w["url"] == url and w["healthy"] for w in workers)


def body(kind: str, i: int) -> dict:
    extra = {"seed": 1000 + i} if kind != "greedy" else {}
    return {
        "messages": [{"role": "user", "content": f"Tell me story number {i} about a fox."}],
        "max_tokens": MAX_TOKENS,
        "stream_options": {"include_usage": True},
        **KINDS[kind],
        **extra,
    }


def text_of(s: Stream, index: int = 0) -> str:
    return "".join(c["delta"].get("content") or "" for c in choices_of(s, index))


def choices_of(s: Stream, index: int) -> list[dict]:
    return [c for e in s.events if isinstance(e, dict) for c in e.get("choices", []) if c["index"] == index]


def token_events(s: Stream) -> int:
    return sum(1 for e in s.events if isinstance(e, dict) and e.get("choices"))


def run_all(stack: PDStack, bodies: list[dict]) -> list[Stream]:
    streams = [Stream(stack.router.url, "/v1/chat/completions", b) for b in bodies]
    for s in streams:
        s.join(scaled(120))
    return streams


def migrations(stack: PDStack) -> float:
    text = requests.get(f"{stack.router.url}/metrics", timeout=scaled(5)).text
    return sum(float(v) for v in re.findall(r"^disagg_router_migrations_total\{[^}]*\} (\S+)$", text, re.M))


def assert_complete(s: Stream) -> None:
    assert s.status == 200 and not s.dropped, (s.status, s.body_text, s.dropped)
    assert s.done and s.events.count("[DONE]") == 1 and not s.error_events, s.events[-3:]
    assert not any("token_ids" in c for e in s.events if isinstance(e, dict) for c in e.get("choices", []))


def interrupted(stack: PDStack, bodies: list[dict]) -> list[Stream]:
    """`bodies` streamed on the decode that runs (X) until each is past its tenth token; X frozen, the other
    decode (Y) started, X killed; the streams once they end."""
    ix = next(i for i, d in enumerate(stack.decodes) if d.proc.poll() is None)
    x, iy = stack.decodes[ix], 1 - ix
    streams = [Stream(stack.router.url, "/v1/chat/completions", b) for b in bodies]
    wait_until(
        lambda: all(token_events(s) >= KILL_AFTER_EVENTS or s.ended_at for s in streams),
        interval=0.01,
        what=f"every stream past its {KILL_AFTER_EVENTS}th token",
    )
    os.killpg(x.proc.pid, signal.SIGSTOP)  # frozen: its streams can neither go on nor end
    try:
        ended = [(s.status, s.body_text[:300], s.dropped, s.events[-2:]) for s in streams if s.ended_at]
        assert not ended, f"streams ended before their decode was frozen: {ended}"
        stack.decodes[iy] = y = stack.start_decode(stack.decodes[iy].port)
        y.wait_healthy()
        wait_until(lambda: healthy(stack, y.url), what="the router sees the new decode healthy")
    finally:
        x.kill()
    for s in streams:
        s.join(scaled(120))
    return streams


@pytest.mark.parametrize("kind", KINDS)
def test_eight_streams_survive_the_kill_of_their_decode_with_the_uninterrupted_answer(stack, kind):
    """Each run starts on the decode the previous one moved to; the other is started once that one is frozen."""
    bodies = [body(kind, i) for i in range(STREAMS)]
    reference = run_all(stack, bodies)
    for s in reference:
        assert_complete(s)
    before = migrations(stack)
    streams = interrupted(stack, bodies)
    for s, ref in zip(streams, reference, strict=True):
        assert_complete(s)
        assert text_of(s) == text_of(ref)
        assert s.usage == ref.usage and s.usage["completion_tokens"] >= KILL_AFTER_EVENTS
    assert migrations(stack) - before == STREAMS


def test_each_choice_of_an_n2_stream_with_logprobs_migrates_on_its_own(stack):
    bodies = [{**body("seeded", i), "n": 2, "logprobs": True, "top_logprobs": 2} for i in range(STREAMS // 2)]
    reference = run_all(stack, bodies)
    before = migrations(stack)
    streams = interrupted(stack, bodies)
    for s, ref in zip(streams, reference, strict=True):
        assert_complete(s)
        assert s.usage == ref.usage
        for index in (0, 1):
            assert text_of(s, index) == text_of(ref, index) != ""
            got, want = (
                [t for c in choices_of(r, index) for t in (c.get("logprobs") or {}).get("content") or []]
                for r in (s, ref)
            )
            assert [t["token"] for t in got] == [t["token"] for t in want] and len(got) == MAX_TOKENS
            assert all(abs(a["logprob"] - b["logprob"]) < 1e-3 for a, b in zip(got, want, strict=True))
    assert migrations(stack) - before == STREAMS


def test_streams_on_speculating_decodes_migrate_with_the_uninterrupted_answer(tiny_model):
    """Decodes that draft with NGRAM: the resumed stream drafts again from its prompt and the tokens it was given.
    Verification draws from the seed's stream once per emitted token, as a step without drafts does, so the
    seeded answers are compared too."""
    stack = start_on_one_decode(tiny_model, NGRAM)
    try:
        for kind in ("greedy", "seeded"):
            bodies = [body(kind, i) for i in range(STREAMS)]
            reference = run_all(stack, bodies)
            before = migrations(stack)
            streams = interrupted(stack, bodies)
            for s, ref in zip(streams, reference, strict=True):
                assert_complete(ref)
                assert_complete(s)
                assert text_of(s) == text_of(ref) and s.usage == ref.usage, kind
            assert migrations(stack) - before == STREAMS
    finally:
        stack.stop()
