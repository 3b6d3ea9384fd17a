"""A client's `traceparent` joins its trace but never forces sampling; the router's legs carry its decision, which
the workers follow (real aiohttp apps with the tracing and auth middlewares, spans kept in memory)."""

from __future__ import annotations

import asyncio
import secrets

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from disagg_worker.http.auth import require_keys
from disagg_worker.http.traced import traced_middlewares
from disagg_worker.tracing import Tracer, Trust

WORKER_TOKEN = "worker-token"


def traced_app(tracer: Tracer, peers: tuple[str, ...] = ()) -> web.Application:
    first, admitted = traced_middlewares(tracer)
    app = web.Application(middlewares=[first, admitted])

    async def complete(request: web.Request) -> web.Response:
        span = Tracer.current()
        return web.json_response({"sampled": span is not None, "headers": tracer.headers(span) if span else {}})

    app.router.add_post("/v1/completions", complete)
    require_keys(app, ("client-key",) if peers else (), peers)
    return app


def client_parent(sampled: bool) -> dict[str, str]:
    return {"traceparent": f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-{'01' if sampled else '00'}"}


async def post(app: web.Application, headers: dict[str, str]) -> dict:
    async with TestClient(TestServer(app)) as c:
        r = await c.post("/v1/completions", json={}, headers=headers)
        assert r.status == 200
        return await r.json()


def spans_of(role: str, ratio: float, trust: Trust, requests: list[dict[str, str]], peers=()) -> tuple[list, list]:
    exporter = InMemorySpanExporter()
    tracer = Tracer(role, "unused:4318", ratio, exporter=exporter, trust=trust)

    async def run() -> list[dict]:
        return [await post(traced_app(tracer, peers), h) for h in requests]

    answers = asyncio.run(run())
    tracer.shutdown()
    return answers, [s for s in exporter.get_finished_spans() if s.name != "admission"]  # the server spans


def test_a_clients_sampled_flag_records_nothing_at_ratio_zero_at_the_router_and_a_monolithic_server():
    # Low trace ids are what a ratio sampler keeps at any ratio above 0: a client's choice, never the decision.
    low = {"traceparent": f"00-{'0' * 31}1-{secrets.token_hex(8)}-01"}
    for role in ("router", "monolithic"):
        answers, spans = spans_of(role, 0.0, Trust.NONE, [client_parent(True), low, {}])
        assert [a["sampled"] for a in answers] == [False] * 3 and spans == [], role


def test_at_ratio_one_a_clients_request_is_sampled_in_the_clients_trace_whatever_its_flag():
    parent = client_parent(False)
    answers, spans = spans_of("router", 1.0, Trust.NONE, [parent])
    assert answers[0]["sampled"] and len(spans) == 1
    assert f"{spans[0].context.trace_id:032x}" == parent["traceparent"].split("-")[1]  # joined, not restarted


def test_the_routers_legs_carry_its_decision_and_the_workers_follow_it_in_one_trace():
    answers, router_spans = spans_of("router", 1.0, Trust.NONE, [client_parent(False)])
    leg = answers[0]["headers"]  # the traceparent the router sends on (its own span's)
    assert leg["traceparent"].endswith("-01")
    # A worker with the model's secret follows the router's flag (ratio 0 of its own), a client's not.
    peer = {**leg, "Authorization": f"Bearer {WORKER_TOKEN}"}
    client = {**client_parent(True), "Authorization": "Bearer client-key"}
    answers, spans = spans_of("decode", 0.0, Trust.PEER, [peer, client], peers=(WORKER_TOKEN,))
    assert [a["sampled"] for a in answers] == [True, False] and len(spans) == 1
    assert spans[0].context.trace_id == router_spans[0].context.trace_id
    assert spans[0].parent is not None and spans[0].parent.span_id == router_spans[0].context.span_id
    unsampled = {**leg, "traceparent": leg["traceparent"][:-2] + "00", "Authorization": f"Bearer {WORKER_TOKEN}"}
    assert [a["sampled"] for a in spans_of("decode", 1.0, Trust.PEER, [unsampled], (WORKER_TOKEN,))[0]] == [False]
    # A worker without the secret is reached by the router alone (a local stack): it follows every parent.
    assert [a["sampled"] for a in spans_of("prefill", 0.0, Trust.ALL, [leg])[0]] == [True]
