"""The endpoint picker in P/D mode: the endpoints are decodes, and a request a decode hands off gets a prefill too,
picked by the router's policies (cache_aware: the prefill holding the prompt's prefix), named in the header
`x-prefiller-host-port`; the prefill's count is given back when the response's headers come; no prefill ready is
a 503 naming it; the subset hint bounds the decodes only."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from disagg_worker.epp import answers
from disagg_worker.epp.exchange import Exchange, Reader
from disagg_worker.epp.generated.envoy.config.core.v3 import base_pb2 as core
from disagg_worker.epp.generated.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from disagg_worker.epp.metrics import EppMetrics
from disagg_worker.epp.pick import DECODE, NO_PREFILL, PREFILL, Picker
from disagg_worker.mem.kv_events import EventLog, page_hashes
from disagg_worker.request.errors import APIError
from disagg_worker.router.policies import Policy
from disagg_worker.router.policies.prefix import Prompt
from disagg_worker.router.worker import Worker
from disagg_worker.router.workers import WorkerPool

PAGE = 4
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def pd_pool(policy: Policy = Policy.LEAST_LOAD) -> tuple[WorkerPool, list[Worker], list[Worker]]:
    decodes = [Worker(f"http://10.0.1.{i}:8000", DECODE, healthy=True) for i in (1, 2)]
    prefills = [Worker(f"http://10.0.2.{i}:8000", PREFILL, healthy=True) for i in (1, 2)]
    return WorkerPool(static=[*decodes, *prefills], policy=policy), decodes, prefills


def test_cache_aware_names_the_prefill_holding_the_prefix_and_picks_the_decode_by_load():
    pool, (d1, d2), (p1, p2) = pd_pool(Policy.CACHE_AWARE)
    system = list(range(100, 164))
    log = EventLog(PAGE, "m")
    log.apply(0, [("stored", page_hashes(system, PAGE))])
    pool.kv_index.of(p2.url).apply(log.since("", -1), time.monotonic())
    d1.inflight = 2  # the decode that holds more requests is not picked
    ids = system + [1, 2, 3]
    picker = Picker(pool, pd=True)
    c = picker.choose(Prompt(len(ids), page_hashes(ids, PAGE), PAGE), handed_off=True)
    assert (c.worker, c.prefill, c.prefiller, c.group) == (d2, p2, "10.0.2.2:8000", None)
    assert (c.tokens, c.prefill_tokens) == (0, 3)  # the decode receives the KV; the prefill computes 3 tokens
    assert (d2.inflight, p2.inflight, p2.pending_tokens) == (1, 1, 3)
    picker.prefilled(c)  # the response's headers: the prefill's part is over
    assert (d2.inflight, p2.inflight, p2.pending_tokens) == (1, 0, 0)
    picker.done(c)
    assert d2.inflight == 0


def test_no_prefill_ready_is_a_503_naming_it_and_the_picker_not_ready():
    pool, _, prefills = pd_pool()
    for p in prefills:
        p.healthy = False
    picker = Picker(pool, pd=True)
    assert not picker.ready()
    with pytest.raises(APIError) as e:
        picker.choose(None, handed_off=True)
    assert e.value.status == 503 and e.value.message == NO_PREFILL
    assert picker.choose(None).prefill is None  # a request no decode hands off (/v1/models) needs none


def test_the_subset_hint_bounds_the_decodes_not_the_prefills():
    pool, (d1, d2), _ = pd_pool()
    c = Picker(pool, pd=True).choose(None, frozenset({"10.0.1.2:8000"}), handed_off=True)
    assert c.worker is d2 and c.prefill is not None


def test_without_prefills_the_picker_is_monolithic_as_before():
    pool, decodes, _ = pd_pool()
    picker = Picker(pool)
    assert picker.role == PREFILL
    c = picker.choose(None, handed_off=True)
    assert c.prefill is None and c.worker.role == PREFILL and not c.prefiller


def run(x: Exchange, *reqs: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
    async def go():
        return [a for r in reqs for a in await x.answer(r)]

    return asyncio.run(go())


def headers(path: str, end: bool = False) -> pb.ProcessingRequest:
    m = core.HeaderMap(headers=[core.HeaderValue(key=":path", raw_value=path.encode())])
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=m, end_of_stream=end))


def set_headers(out: pb.ProcessingResponse) -> dict[str, str]:
    common = out.request_headers.response
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def test_the_answer_names_the_prefill_and_the_response_headers_give_it_back():
    pool, (d1, _), (p1, _) = pd_pool()
    d1.report = {"dp_loads": [3, 0]}  # a decode's groups are its hand-off's to pick: none named in the body
    x = Exchange(Picker(pool, pd=True), Reader("m"), EppMetrics())
    raw = json.dumps(CHAT).encode()
    out = run(
        x, headers("/v1/chat/completions"), pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True))
    )
    assert set_headers(out[0]) == {
        answers.DESTINATION: "10.0.1.1:8000",
        answers.PREFILLER: "10.0.2.1:8000",
        "content-length": str(len(raw)),
    }
    assert out[1].request_body.response.body_mutation.streamed_response.body == raw
    assert (d1.inflight, p1.inflight) == (1, 1)
    run(x, pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
    assert (d1.inflight, p1.inflight) == (1, 0)
    x.close()
    assert (d1.inflight, p1.inflight) == (0, 0)


def test_a_request_no_decode_hands_off_names_no_prefill():
    pool, _, prefills = pd_pool()
    x = Exchange(Picker(pool, pd=True), Reader("m"), EppMetrics())
    (out,) = run(x, headers("/v1/models", end=True))
    assert set_headers(out) == {answers.DESTINATION: "10.0.1.1:8000"}
    x.close()
    assert all(p.inflight == 0 for p in prefills)


def serving(w: Worker, adapters: list[str], resident: list[str]) -> Worker:
    w.report = {"lora_adapters": adapters, "lora_resident": resident}  # as its /health lists them
    return w


def test_a_request_for_an_adapter_goes_to_a_pair_serving_it_resident_first_and_others_are_refused():
    pool, (d1, d2), (p1, p2) = pd_pool()
    serving(d1, ["attn", "mlp"], ["attn"])
    serving(d2, ["attn", "mlp"], ["mlp"])
    serving(p1, ["attn"], ["attn"])
    serving(p2, ["attn", "mlp"], ["mlp"])
    picker = Picker(pool, pd=True)
    assert picker.adapters() == ["attn", "mlp"]
    c = picker.choose(None, handed_off=True, adapter="mlp")
    assert (c.worker, c.prefill) == (d2, p2)  # the decode holding it resident; the one prefill serving it
    d2.inflight = 20  # far busier: the other decode, which serves it too, takes it (and loads it)
    assert picker.choose(None, handed_off=True, adapter="mlp").worker is d1
    assert picker.choose(None, handed_off=True).worker is d1  # the base: by load alone

    # Through the exchange: the body's `model` selects the adapter; a name no pair serves is the workers' 404.
    x = Exchange(picker, Reader("m"), EppMetrics())
    raw = json.dumps({**CHAT, "model": "attn"}).encode()
    out = run(
        x, headers("/v1/chat/completions"), pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True))
    )
    assert set_headers(out[0])[answers.DESTINATION] == "10.0.1.1:8000"  # attn resident there
    x.close()
    x = Exchange(picker, Reader("m"), EppMetrics())
    raw = json.dumps({**CHAT, "model": "sql"}).encode()
    out = run(
        x, headers("/v1/chat/completions"), pb.ProcessingRequest(request_body=pb.HttpBody(body=raw, end_of_stream=True))
    )
    refused = out[-1].immediate_response
    assert refused.status.code == 404 and b'"param": "model"' in refused.body
    x.close()


def test_no_ready_endpoint_serving_the_adapter_is_a_503_naming_it():
    pool, (d1, d2), _ = pd_pool()
    serving(d1, ["attn"], [])
    d1.healthy = False
    with pytest.raises(APIError) as e:
        Picker(pool, pd=True).choose(None, adapter="attn")
    assert e.value.status == 503 and "LoRA adapter attn" in e.value.message
