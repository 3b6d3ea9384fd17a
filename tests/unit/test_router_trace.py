"""A retried choice's trace: one `attempt` span per pair tried, each with its legs, and each leg's request carrying
its own span's W3C context; a migrated stream's: one attempt per hop (fake prefill and decode servers on
127.0.0.1, spans kept in memory)."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from disagg_worker.router.app import Router
from disagg_worker.router.migrate import MigratingChoice, with_token_ids
from disagg_worker.router.payload import SharedBody
from disagg_worker.router.workers import Worker
from disagg_worker.tracing import Tracer, traces_url
from tests.unit.test_router_pairs import BODY, decode_app, prefill_app, with_router


def remembering(app: web.Application, seen: list[str]) -> web.Application:
    """`app`, noting the `traceparent` of every request it gets."""

    @web.middleware
    async def note(request: web.Request, handler):
        seen.append(request.headers.get("traceparent", ""))
        return await handler(request)

    app.middlewares.append(note)
    return app


def test_each_attempt_of_a_retried_choice_is_a_span_with_its_two_legs():
    exporter = InMemorySpanExporter()
    tracer = Tracer("router", "unused:4318", exporter=exporter)
    to_decodes: list[str] = []
    to_prefill: list[str] = []

    async def check(router: Router, workers: list[Worker]) -> None:
        router.tracer = tracer
        with tracer.server_span("router POST /v1/completions", {}):
            router.close(await router.open("/v1/completions", BODY, {"n": 1}))

    apps = [remembering(decode_app("drop", {}), to_decodes), remembering(decode_app("ok", {}), to_decodes)]
    asyncio.run(with_router([remembering(prefill_app("ok"), to_prefill)], apps, check))
    tracer.shutdown()

    spans = exporter.get_finished_spans()
    root = next(s for s in spans if s.name.startswith("router "))
    attempts = sorted((s for s in spans if s.name == "attempt"), key=lambda s: s.attributes["disagg.attempt"])
    assert [a.parent.span_id for a in attempts] == [root.context.span_id] * 2
    assert [a.status.status_code for a in attempts] == [StatusCode.ERROR, StatusCode.UNSET]
    for a, sent_to_decode, sent_to_prefill in zip(attempts, to_decodes, to_prefill, strict=True):
        legs = {s.name: s for s in spans if s.parent is not None and s.parent.span_id == a.context.span_id}
        assert set(legs) == {"prefill", "decode"}
        # Each worker's request names its own leg as its parent, in the one trace, sampled.
        for sent, leg in ((sent_to_decode, legs["decode"]), (sent_to_prefill, legs["prefill"])):
            version, trace_id, parent, flags = sent.split("-")
            assert (trace_id, parent) == (f"{root.context.trace_id:032x}", f"{leg.context.span_id:016x}")
            assert int(flags, 16) & 1, "sampled"
    assert attempts[0].attributes["disagg.decode"] != attempts[1].attributes["disagg.decode"]


def test_the_endpoint_is_a_host_and_port_or_a_url():
    assert traces_url("collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("https://otel.example/") == "https://otel.example/v1/traces"
    assert traces_url("http://c:4318/custom/path") == "http://c:4318/custom/path"


def streaming_decode(tokens: list[int], finish: bool) -> web.Application:
    """A decode that streams one event per token; without `finish` it drops the connection after them."""

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i, t in enumerate(tokens):
            last = finish and i == len(tokens) - 1
            choice = {"index": 0, "text": f"t{t}", "token_ids": [t], "finish_reason": "length" if last else None}
            await out.write(f"data: {json.dumps({'id': 'cmpl-1', 'choices': [choice]})}\n\n".encode())
        if finish:
            await out.write(b"data: [DONE]\n\n")
            return out
        assert request.transport is not None
        request.transport.abort()
        return out

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    return app


def test_a_migrated_stream_shows_each_hop_as_an_attempt():
    exporter = InMemorySpanExporter()
    tracer = Tracer("router", "unused:4318", exporter=exporter)
    body = SharedBody.of({"prompt": "hi", "max_tokens": 5, "stream": True})

    async def check(router: Router, workers: list[Worker]) -> None:
        router.tracer, router.migration_limit = tracer, 1
        with tracer.server_span("router POST /v1/completions", {}):
            choice = with_token_ids(router, "/v1/completions", body, {})
            c = MigratingChoice(
                router, "/v1/completions", body, choice, await router.open("/v1/completions", body, choice)
            )
            got = [t for e in [e async for e in c.events()] for ch in e["choices"] for t in [ch["text"]]]
            c.close()
        assert got == ["t1", "t2", "t3", "t4", "t5"]

    decodes = [streaming_decode([1, 2], finish=False), streaming_decode([3, 4, 5], finish=True)]
    asyncio.run(with_router([prefill_app("ok")], decodes, check))
    tracer.shutdown()

    attempts = sorted((s for s in exporter.get_finished_spans() if s.name == "attempt"), key=lambda s: s.start_time)
    assert [a.attributes["disagg.resumed_tokens"] for a in attempts] == [0, 2]
    assert attempts[0].status.status_code is StatusCode.ERROR and "migrated" in attempts[0].status.description
    assert attempts[1].status.status_code is StatusCode.UNSET
    assert attempts[0].attributes["disagg.decode"] != attempts[1].attributes["disagg.decode"]
