"""Flow control at the admission (`http/flow_gate.py`), as a client sees it: a request beyond the in-flight bound
waits and is served once a slot frees, the highest priority first; the queue's time to live, eviction and bound
answer 429 with Retry-After; a bad priority is a 400 naming its field; a client that leaves leaves the queue."""

from __future__ import annotations

import asyncio
import hashlib
import json

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry, generate_latest

from disagg_worker.cli import build_parser
from disagg_worker.flow.identity import FAIRNESS_HEADER, OBJECTIVE_HEADER
from disagg_worker.flow.policy import FlowPolicy
from disagg_worker.http.admission import Admission, admission_middleware, body_of
from disagg_worker.http.auth import require_keys
from disagg_worker.http.errors import error_middleware
from disagg_worker.http.flow_gate import NO_FLOW_CONTROL, FlowGate, priority_of
from disagg_worker.router.flow_control import FlowCollector, flow_control

LIMIT = 10_000


def app_with(
    admission: Admission, release: asyncio.Event, served: list[str], given: dict[str, int | None]
) -> web.Application:
    """/generate notes the body's name when it starts (and the priority flow control gave it, in `given`), then
    holds its slot until `release` is set."""

    async def generate(request: web.Request) -> web.Response:
        name = json.loads(body_of(request))["name"]
        served.append(name)
        given[name] = priority_of(request)
        await release.wait()
        return web.json_response({"name": name})

    app = web.Application(middlewares=[error_middleware, admission_middleware(admission)])
    app.router.add_post("/generate", generate)
    return app


class Front:
    """One in-flight slot, a flow gate of `policy` in front of it (behind API `keys`, if any), and a client."""

    def __init__(self, policy: FlowPolicy, keys: tuple[str, ...] = ()):
        self.gate = FlowGate(policy)
        self.admission = Admission(1, lambda: LIMIT, flow=self.gate)
        self.release = asyncio.Event()
        self.served: list[str] = []
        self.given: dict[str, int | None] = {}
        app = app_with(self.admission, self.release, self.served, self.given)
        require_keys(app, keys)
        self.server = TestServer(app)

    async def __aenter__(self) -> Front:
        await self.server.start_server()
        self.session = ClientSession()
        return self

    async def __aexit__(self, *exc) -> None:
        self.release.set()
        await self.session.close()
        await self.server.close()

    async def post(self, name: str, headers: dict | None = None, **fields) -> tuple[int, dict, dict]:
        url = f"http://127.0.0.1:{self.server.port}/generate"
        async with self.session.post(url, json={"name": name, **fields}, headers=headers or {}) as r:
            return r.status, dict(r.headers), await r.json()

    def send(self, name: str, headers: dict | None = None, **fields) -> asyncio.Task:
        return asyncio.create_task(self.post(name, headers, **fields))

    async def until(self, check) -> None:
        for _ in range(500):
            if check():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the front end never got there")


def run(coro):
    return asyncio.run(coro)


def test_queued_requests_are_served_as_slots_free_the_highest_priority_first():
    async def go():
        async with Front(FlowPolicy(objectives={"batch": -1})) as f:
            holder = f.send("holder")
            await f.until(lambda: f.served == ["holder"])
            waiting = [
                f.send("batch", {OBJECTIVE_HEADER: "batch"}),
                f.send("default"),
                f.send("urgent", priority=5),
            ]
            await f.until(lambda: f.gate.queued == 3)
            f.release.set()
            answers = await asyncio.gather(holder, *waiting)
            return f.served, answers, f.admission.inflight

    served, answers, inflight = run(go())
    assert served == ["holder", "urgent", "default", "batch"]
    assert [a[0] for a in answers] == [200] * 4 and inflight == 0


def test_a_request_that_waits_past_the_ttl_gets_429_with_retry_after():
    async def go():
        async with Front(FlowPolicy(ttl_s=0.2)) as f:
            f.send("holder")
            await f.until(lambda: f.served == ["holder"])
            return await f.post("late")

    status, headers, body = run(go())
    assert status == 429 and headers["Retry-After"] == "1"
    assert body["error"]["code"] == "rate_limit_exceeded" and "waited 0.2 s in the queue" in body["error"]["message"]


@pytest.mark.parametrize(
    ("headers", "fields", "param"),
    [({}, {"priority": "high"}, "priority"), ({}, {"priority": 99}, "priority"), ({OBJECTIVE_HEADER: "x"}, {}, None)],
)
def test_a_bad_priority_is_a_400_naming_its_field_even_with_a_slot_free(headers, fields, param):
    async def go():
        async with Front(FlowPolicy()) as f:
            return await f.post("bad", headers, **fields)

    status, _, body = run(go())
    assert status == 400 and body["error"]["param"] == (param or OBJECTIVE_HEADER)


def test_a_full_queue_sheds_the_lowest_priority_newest_then_refuses_the_lowest():
    async def go():
        async with Front(FlowPolicy(queue_size=2)) as f:
            f.send("holder")
            await f.until(lambda: f.served == ["holder"])
            old, new = f.send("old", priority=-1), None
            await f.until(lambda: f.gate.queued == 1)
            new = f.send("new", priority=-1)
            await f.until(lambda: f.gate.queued == 2)
            urgent = f.send("urgent", priority=3)
            shed = await new
            refused = await f.post("another", priority=-1)
            f.release.set()
            await asyncio.gather(old, urgent)
            registry = CollectorRegistry(auto_describe=False)
            registry.register(FlowCollector(f.gate))
            return f.served, shed, refused, generate_latest(registry).decode()

    served, shed, refused, metrics = run(go())
    assert served == ["holder", "urgent", "old"]
    assert shed[0] == 429 and "shed" in shed[2]["error"]["message"] and shed[1]["Retry-After"] == "1"
    assert refused[0] == 429 and "is full" in refused[2]["error"]["message"]
    assert 'disagg_router_flow_requests_total{flow="",outcome="evicted",priority="-1"} 1.0' in metrics
    assert 'disagg_router_flow_requests_total{flow="",outcome="dispatched",priority="3"} 1.0' in metrics


def test_a_client_that_leaves_while_queued_leaves_the_queue_and_its_turn_goes_on():
    async def go():
        async with Front(FlowPolicy()) as f:
            f.send("holder")
            await f.until(lambda: f.served == ["holder"])
            body = json.dumps({"name": "leaver"}).encode()
            reader, writer = await asyncio.open_connection("127.0.0.1", f.server.port)
            writer.write(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await f.until(lambda: f.gate.queued == 1)
            writer.close()
            await f.until(lambda: f.gate.queued == 0)
            stayer = f.send("stayer", {FAIRNESS_HEADER: "team-b"})
            await f.until(lambda: f.gate.queued == 1)
            f.release.set()
            return f.served, await stayer, f.admission.inflight

    served, stayer, inflight = run(go())
    assert served == ["holder", "stayer"] and stayer[0] == 200 and inflight == 0


def test_a_drain_refuses_what_is_queued():
    async def go():
        async with Front(FlowPolicy()) as f:
            f.send("holder")
            await f.until(lambda: f.served == ["holder"])
            queued = f.send("queued")
            await f.until(lambda: f.gate.queued == 1)
            f.admission.start_drain()
            return await queued

    status, headers, body = run(go())
    assert status == 503 and body["error"]["code"] == "draining" and headers["Retry-After"] == "1"


def test_the_router_flags_build_the_gate_and_a_malformed_one_stops_start_up():
    parser = build_parser()
    words = ["router", "--flow-control", "--flow-objectives", "batch=-1,chat=4", "--flow-queue-ttl", "5"]
    ns = parser.parse_args(words)
    gate = flow_control(ns)
    assert isinstance(gate, FlowGate) and gate.policy.objectives == {"batch": -1, "chat": 4}
    assert gate.policy.ttl_s == 5.0 and gate.policy.queue_size == 256
    assert flow_control(parser.parse_args(["router"])) is NO_FLOW_CONTROL
    for bad in ("abc", "my-key=3"):  # not NAME=PRIORITY; a key itself, not its digest
        with pytest.raises(SystemExit, match="--flow-key-priority"):
            flow_control(parser.parse_args(["router", "--flow-control", "--flow-key-priority", bad]))
    with pytest.raises(SystemExit, match="outside"):
        flow_control(parser.parse_args(["router", "--flow-control", "--flow-objectives", "x=11"]))


def test_a_keys_requests_are_capped_at_its_priority_and_are_its_own_flow():
    """With API keys, the key (its digest, as `--flow-key-priority` names it) is the flow, whatever fairness id
    the client sends, and a priority above the key's cap is served at the cap."""
    key = "sk-team-a"
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]

    async def go():
        async with Front(FlowPolicy(key_max={digest: 1}), keys=(key, "sk-other")) as f:
            auth = {"Authorization": f"Bearer {key}", FAIRNESS_HEADER: "someone-else"}
            holder = f.send("holder", {"Authorization": "Bearer sk-other"})
            await f.until(lambda: f.served == ["holder"])
            capped = f.send("capped", auth, priority=9)
            await f.until(lambda: f.gate.queued == 1)
            other = f.send("other", {"Authorization": "Bearer sk-other"}, priority=5)
            await f.until(lambda: f.gate.queued == 2)
            flows = f.gate.queued_by_flow()
            f.release.set()
            await asyncio.gather(holder, capped, other)
            return f.served, flows, f.given

    served, flows, given = run(go())
    assert served == ["holder", "other", "capped"]  # the cap (1) is below the other key's 5
    # What the router forwards (and the workers' priority scheduling reads) is the capped priority.
    assert given == {"holder": 0, "other": 5, "capped": 1}
    assert flows[(1, digest)] == 1 and not any(flow == "someone-else" for _, flow in flows)
