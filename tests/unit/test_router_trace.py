"""A retried choice's trace: one `attempt` span per pair tried, each with its legs, and each leg's request carrying
its own span's W3C context (fake prefill and decode servers on 127.0.0.1, spans kept in memory)."""

from __future__ import annotations

import asyncio

from aiohttp import web
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from disagg_worker.router.app import Router
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
