"""A decode whose engine stops stepping while its HTTP side still answers /health: its streams stall, the router
holds it out of rotation before they migrate, and takes it back once the hold has passed.

One prefill and two decodes (X and Y) behind a router with a short --stream-stall-timeout. X runs with the fault
hook DISAGG_FAULT_STALL_DECODE: its scheduler loop takes no step while a file exists, and goes on reporting, so
its /health stays 200. Streams are spread over X and Y; once each is past its tenth token the file is created
(a round in which X holds none of them by then starts over): X's streams stall, and since X delivered nothing on
any stream the router holds X out, then migrates them to Y, where they finish with the uninterrupted answer.
While X is held out (and still stalled) new requests go to Y alone; once the file is gone and the hold has
passed, X takes requests again.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.integration.procs import PDStack, Stream, idle_now, scaled, wait_until

pytestmark = pytest.mark.integration
STREAMS = 4
MAX_TOKENS = 300  # long enough that no stream ends between its tenth token and the stall
STALL_AFTER_EVENTS = 10
ROUNDS = 5  # rounds of streams until X stalls under at least one of them
STALL_S = scaled(3.0)  # --stream-stall-timeout: far beyond a step of Y, on a loaded machine too
HOLD_S = scaled(8.0)  # --stall-hold: long enough for the requests sent while X is held out
FLAGS = ("--page-size", "16", "--chunk-size", "64")


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    flag = tmp_path_factory.mktemp("stall") / "decode-x-stalled"
    router_flags = ("--verify-interval", "0", "--stream-stall-timeout", f"{STALL_S:g}", "--stall-hold", f"{HOLD_S:g}")
    s = PDStack(
        tiny_model,
        *FLAGS,
        decodes=2,
        decode_envs=({"DISAGG_FAULT_STALL_DECODE": str(flag)},),
        router_flags=router_flags,
    )
    s.wait_healthy()
    yield s, flag
    s.stop()


def body(i: int) -> dict:
    kind = {"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "top_p": 0.95, "seed": 500 + i}
    return {
        "messages": [{"role": "user", "content": f"Tell me story number {i} about a heron."}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        **kind,
    }


def text_of(s: Stream) -> str:
    return "".join(c["delta"].get("content") or "" for e in s.events if isinstance(e, dict) for c in e["choices"])


def token_events(s: Stream) -> int:
    return sum(1 for e in s.events if isinstance(e, dict) and e.get("choices"))


def worker(stack: PDStack, url: str) -> dict:
    """The router's description of the worker at `url` (its /health)."""
    workers = requests.get(f"{stack.router.url}/health", timeout=scaled(5)).json()["workers"]
    return next(w for w in workers if w["url"] == url)


def counter(url: str, name: str, labels: str = "") -> float:
    """A counter of `url`'s /metrics, summed over the series whose labels contain `labels`."""
    text = requests.get(f"{url}/metrics", timeout=scaled(5)).text
    found = re.findall(rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$", text, re.M)
    return sum(float(v) for ls, v in found if labels in ls)


def complete(stack: PDStack, i: int) -> int:
    r = requests.post(
        f"{stack.router.url}/v1/completions",
        json={"prompt": f"Count to {i}:", "max_tokens": 4, "temperature": 0},
        timeout=scaled(60),
    )
    return r.status_code


def run_all(stack: PDStack) -> list[Stream]:
    streams = [Stream(stack.router.url, "/v1/chat/completions", body(i)) for i in range(STREAMS)]
    for s in streams:
        s.join(scaled(120))
    return streams


def assert_complete(s: Stream) -> None:
    assert s.status == 200 and not s.dropped, (s.status, s.body_text, s.dropped)
    assert s.done and s.events.count("[DONE]") == 1 and not s.error_events, s.events[-3:]


def stall_under_streams(stack: PDStack, flag, reference: list[Stream]) -> tuple[list[Stream], int]:
    """Streams sent, X stalled once each is past its tenth token or done: the streams and how many X holds.

    On a loaded machine one stream may wait for its prefill while another finishes its answer, so X may hold
    none of them by then; those streams end as they are (their answers checked), X steps again and the round
    starts over, until X stalls under at least one stream."""
    for _ in range(ROUNDS):
        streams = [Stream(stack.router.url, "/v1/chat/completions", body(i)) for i in range(STREAMS)]
        wait_until(
            lambda streams=streams: all(token_events(st) >= STALL_AFTER_EVENTS or st.ended_at for st in streams),
            interval=0.01,
            what=f"every stream past its {STALL_AFTER_EVENTS}th token",
        )
        flag.touch()  # X takes no further step
        on_x = worker(stack, stack.decodes[0].url)["inflight"]
        if on_x:
            return streams, on_x
        flag.unlink()
        for st, ref in zip(streams, reference, strict=True):
            st.join(scaled(120))
            assert_complete(st)
            assert text_of(st) == text_of(ref)
    pytest.fail(f"X held no stream when it stalled, {ROUNDS} rounds in a row")


def test_a_stalled_decode_is_held_out_its_streams_migrate_and_it_serves_again_once_it_steps(stack):
    s, flag = stack
    x, y = s.decodes
    router = s.router.url
    reference = run_all(s)
    for ref in reference:
        assert_complete(ref)
    migrated = counter(router, "disagg_router_migrations_total", 'cause="stall"')
    held = counter(router, "disagg_router_stream_stalls_total", 'verdict="decode"')
    slow = counter(router, "disagg_router_stream_stalls_total", 'verdict="request"')

    streams, on_x = stall_under_streams(s, flag, reference)
    assert 0 < on_x < STREAMS

    wait_until(lambda: "held_out_s" in worker(s, x.url), timeout=scaled(30), what="the router holds X out")
    assert requests.get(f"{x.url}/health", timeout=scaled(5)).status_code == 200  # X says it is fine
    routed = counter(router, "disagg_router_requests_routed_total")
    with ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(lambda i: complete(s, i), range(4)))
    assert statuses == [200] * 4
    assert counter(router, "disagg_router_requests_routed_total") - routed == 4  # each went to Y at once
    assert "held_out_s" in worker(s, x.url) and flag.exists()  # ... while X was held out, and stalled

    for st, ref in zip(streams, reference, strict=True):
        st.join(scaled(120))
        assert_complete(st)
        assert text_of(st) == text_of(ref) and st.usage == ref.usage
    assert counter(router, "disagg_router_migrations_total", 'cause="stall"') - migrated == on_x
    assert counter(router, "disagg_router_stream_stalls_total", 'verdict="decode"') - held == on_x
    assert counter(router, "disagg_router_stream_stalls_total", 'verdict="request"') == slow

    flag.unlink()  # X steps again: it ends the streams that left it
    idle_now(x.url)
    wait_until(lambda: "held_out_s" not in worker(s, x.url), timeout=HOLD_S + scaled(30), what="X's hold passes")
    served = counter(x.url, "disagg_requests_total")
    for i in range(4):  # round robin over X and Y
        assert complete(s, i) == 200
    wait_until(lambda: counter(x.url, "disagg_requests_total") > served, timeout=scaled(10), what="X serves again")
