"""Flow control at the router in front of a real P/D pair: who waits, who is shed, in which order they are served.

One prefill and one decode behind a router with `--flow-control --max-inflight 1 --flow-queue-size 5`: one
request at a time reaches the pair, the others wait in the router's queue. The decode runs with the fault hook
DISAGG_FAULT_STALL_DECODE, so that the request holding the one slot is held there, mid-stream, for as long as the
test needs (its loop takes no step while the file exists): the queue is filled while nothing can leave it, then
the file goes and the queue drains one request at a time, the order the clients see being the order of dispatch.
Two tenants name their flows with `x-gateway-inference-fairness-id`; one request asks for priority 10 through
the official `openai` client (`extra_body`).
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from tests.integration.procs import PDStack, Stream, idle_now, scaled, wait_until

pytestmark = pytest.mark.integration
FAIRNESS = "x-gateway-inference-fairness-id"
QUEUE = 5
HOLDER_TOKENS = 1000  # far more than the decode steps between the holder's first token and the stall
ROUTER_FLAGS = (
    "--flow-control",
    "--max-inflight",
    "1",
    "--flow-queue-size",
    str(QUEUE),
    "--flow-queue-ttl",
    "600",
    "--stream-stall-timeout",
    "0",
    "--stall-after",
    "600",
)


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    flag = tmp_path_factory.mktemp("flow") / "decode-stalled"
    s = PDStack(
        tiny_model,
        "--page-size",
        "16",
        decode_envs=({"DISAGG_FAULT_STALL_DECODE": str(flag)},),
        router_flags=ROUTER_FLAGS,
    )
    s.wait_healthy()
    yield s, flag
    s.stop()


def queued(url: str) -> dict[tuple[str, str], float]:
    """The router's `disagg_router_flow_queued` by (priority, flow)."""
    text = requests.get(f"{url}/metrics", timeout=scaled(5)).text
    out = {}
    for labels, value in re.findall(r"^disagg_router_flow_queued\{([^}]*)\} (\S+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if float(value):
            out[(got["priority"], got["flow"])] = float(value)
    return out


class Ask(threading.Thread):
    """One non-streamed completion of tenant `flow`, sent on its own thread: its status, body and when it ended."""

    def __init__(self, url: str, name: str, flow: str):
        super().__init__(daemon=True)
        self.url, self.name, self.flow = url, name, flow
        self.status, self.body, self.ended = 0, {}, 0.0
        self.start()

    def run(self) -> None:
        body = {"prompt": f"Request {self.name}:", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = requests.post(f"{self.url}/v1/completions", json=body, headers={FAIRNESS: self.flow}, timeout=scaled(120))
        self.status, self.body, self.ended = r.status_code, r.json(), time.monotonic()


def test_a_tenants_burst_is_shed_for_the_other_tenant_and_priority_goes_first(stack):
    s, flag = stack
    url = s.router.url
    hold = {"prompt": "Hold the slot:", "max_tokens": HOLDER_TOKENS, "ignore_eos": True}
    holder = Stream(url, "/v1/completions", hold)
    wait_until(lambda: holder.started.is_set(), timeout=60, what="the holder's first token")
    flag.touch()  # the decode takes no step: the holder keeps the one slot
    assert not holder.ended_at, holder.events[-2:]
    try:
        asks: dict[str, Ask] = {}

        def ask(name: str, flow: str, expect: dict[tuple[str, str], float]) -> Ask:
            asks[name] = Ask(url, name, flow)
            wait_until(lambda: queued(url) == expect, timeout=30, what=f"{name} queued: {expect}")
            return asks[name]

        for i in range(1, QUEUE + 1):  # tenant a's burst fills the queue
            ask(f"a{i}", "a", {("0", "a"): i})
        # Tenant b's first requests take the places of a's newest, one each, while a holds two more than b.
        ask("b1", "b", {("0", "a"): 4, ("0", "b"): 1})
        ask("b2", "b", {("0", "a"): 3, ("0", "b"): 2})
        for shed in ("a5", "a4"):
            asks[shed].join(scaled(30))
            assert asks[shed].status == 429, (shed, asks[shed].status, asks[shed].body)
            assert "of a flow with fewer waiting" in asks[shed].body["error"]["message"], asks[shed].body
        # Now a holds 3 and b 2: b's next is refused, the queue full with nothing it may shed.
        b3 = Ask(url, "b3", "b")
        b3.join(scaled(30))
        assert b3.status == 429 and "is full" in b3.body["error"]["message"], b3.body
        assert b3.body["error"]["code"] == "rate_limit_exceeded"

        # A request of priority 10 sheds the lowest band's largest flow's newest (a3) and waits first in line.
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=scaled(120))

        def urgent_ask():
            answer = client.completions.create(
                model="tiny",
                prompt="Urgent:",
                max_tokens=8,
                temperature=0,
                extra_body={"priority": 10, "ignore_eos": True},
                extra_headers={FAIRNESS: "b"},
            )
            return answer, time.monotonic()

        with ThreadPoolExecutor(1) as pool:
            urgent = pool.submit(urgent_ask)
            wait_until(
                lambda: queued(url) == {("10", "b"): 1, ("0", "a"): 2, ("0", "b"): 2},
                timeout=30,
                what="the urgent request queued",
            )
            asks["a3"].join(scaled(30))
            assert asks["a3"].status == 429 and "of higher priority" in asks["a3"].body["error"]["message"]
            assert holder.ended_at == 0.0  # nothing left the queue but what was shed

            flag.unlink()  # the decode steps again: the holder ends, the queue drains one at a time
            answer, urgent_at = urgent.result(scaled(120))
        assert answer.usage.completion_tokens == 8
    finally:
        flag.unlink(missing_ok=True)
    holder.join(scaled(60))
    assert holder.done and not holder.error_events, holder.events[-3:]
    served = [asks[n] for n in ("a1", "a2", "b1", "b2")]
    for a in served:
        a.join(scaled(120))
        assert a.status == 200 and a.body["usage"]["completion_tokens"] == 8, (a.name, a.status, a.body)
    # The urgent one first, then the two tenants' flows in turns (a joined the ring first), each in arrival order.
    assert all(a.ended > urgent_at for a in served)
    assert [a.name for a in sorted(served, key=lambda a: a.ended)] == ["a1", "b1", "a2", "b2"]
    idle_now(s.decode.url)
