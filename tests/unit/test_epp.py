"""The endpoint picker's pure parts: a body read as the workers read it (their 4xx for a bad one, 413 past the
limit), the subset hint, the pick (the router's policies, 503 when none is ready or none of the hint's, 429 when all
are full), and how the answers travel back to the gateway (header, `envoy.lb` metadata, the body, ImmediateResponse
with the OpenAI error body)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from disagg_worker.epp import answers
from disagg_worker.epp.exchange import Exchange, Reader
from disagg_worker.epp.generated.envoy.config.core.v3 import base_pb2 as core
from disagg_worker.epp.generated.envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import (
    ProcessingMode,
)
from disagg_worker.epp.generated.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from disagg_worker.epp.metrics import EppMetrics
from disagg_worker.epp.pick import ROLE, Picker, address
from disagg_worker.epp.request_body import BodyBuffer, read_request, scored
from disagg_worker.mem.kv_events import EventLog, page_hashes
from disagg_worker.request.errors import APIError
from disagg_worker.router.policies import Policy
from disagg_worker.router.policies.prefix import Prompt
from disagg_worker.router.worker import Worker
from disagg_worker.router.workers import WorkerPool

PAGE = 4
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def pool_of(*hosts: str, policy: Policy = Policy.LEAST_LOAD) -> tuple[WorkerPool, list[Worker]]:
    workers = [Worker(f"http://{h}", ROLE, healthy=True) for h in hosts]
    return WorkerPool(static=list(workers), policy=policy), workers


def test_a_body_is_checked_by_the_workers_parsers_and_names_the_field():
    assert read_request("/v1/chat/completions", json.dumps(CHAT).encode(), "m") == CHAT
    with pytest.raises(APIError) as e:
        read_request("/v1/chat/completions", b'{"model": "m", "messages": []}', "m")
    assert (e.value.status, e.value.param) == (400, "messages")
    with pytest.raises(APIError) as e:
        read_request("/v1/completions", b'{"model": "m"}', "m")
    assert (e.value.status, e.value.param) == (400, "prompt")
    with pytest.raises(APIError) as e:
        read_request("/v1/responses", b'{"model": "m", "input": 3}', "m")
    assert (e.value.status, e.value.param) == (400, "input")
    with pytest.raises(APIError) as e:
        read_request("/generate", b'{"text": "a", "input_ids": [1]}', "m")
    assert e.value.status == 400
    with pytest.raises(APIError) as e:
        read_request("/v1/chat/completions", b"{not json", "m")
    assert e.value.status == 400 and "JSON" in e.value.message
    with pytest.raises(APIError) as e:
        read_request("/v1/chat/completions", json.dumps({**CHAT, "model": "other"}).encode(), "m")
    assert (e.value.status, e.value.code) == (404, "model_not_found")


def test_a_responses_request_is_scored_as_the_chat_request_it_runs_as():
    path, body = scored("/v1/responses", {"model": "m", "input": "hello", "instructions": "be brief"})
    assert path == "/v1/chat/completions"
    assert body["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


def test_a_body_past_its_limit_is_a_413():
    b = BodyBuffer(10)
    b.add(b"12345")
    b.add(b"67890")
    with pytest.raises(APIError) as e:
        b.add(b"x")
    assert e.value.status == 413 and b.chunks == []


def test_the_subset_hint_is_read_from_the_filter_metadata():
    req = pb.ProcessingRequest()
    assert answers.subset_of(req) is None
    hint = req.metadata_context.filter_metadata[answers.SUBSET_HINT]
    hint.fields[answers.SUBSET].list_value.values.add().string_value = "10.0.0.2:8000"
    assert answers.subset_of(req) == {"10.0.0.2:8000"}


def test_the_pick_stays_within_the_subset_and_503s_when_none_of_it_is_ready():
    pool, (a, b) = pool_of("10.0.0.1:8000", "10.0.0.2:8000")
    picker = Picker(pool)
    for _ in range(3):
        c = picker.choose(None, frozenset({"10.0.0.2:8000"}))
        assert c.endpoints == ("10.0.0.2:8000",)
    b.healthy = False
    with pytest.raises(APIError) as e:
        picker.choose(None, frozenset({"10.0.0.2:8000"}))
    assert e.value.status == 503 and "subset" in e.value.message
    with pytest.raises(APIError) as e:
        picker.choose(None, frozenset())
    assert e.value.status == 503


def test_no_ready_endpoint_is_a_503_and_a_full_pool_a_429():
    pool, (a, b) = pool_of("10.0.0.1:8000", "10.0.0.2:8000")
    a.healthy = b.healthy = False
    with pytest.raises(APIError) as e:
        Picker(pool).choose(None)
    assert e.value.status == 503
    a.healthy = b.healthy = True
    picker = Picker(pool, max_queue=1)
    first, second = picker.choose(None), picker.choose(None)
    assert {first.worker, second.worker} == {a, b}  # least load spreads them
    with pytest.raises(APIError) as e:
        picker.choose(None)
    assert (e.value.status, e.value.retry_after) == (429, 1)
    picker.done(first)
    assert picker.choose(None).worker is first.worker


def test_a_reported_load_counts_toward_the_queue_bound():
    pool, (a,) = pool_of("10.0.0.1:8000")
    a.report = {"load": {"requests": 4}}
    with pytest.raises(APIError) as e:
        Picker(pool, max_queue=4).choose(None)
    assert e.value.status == 429


def test_fallbacks_follow_the_pick_by_load():
    pool, (a, b, c) = pool_of("10.0.0.1:8000", "10.0.0.2:8000", "[fd00::3]:8000")
    b.inflight, c.inflight = 5, 1
    choice = Picker(pool, fallbacks=2).choose(None)
    assert choice.value == "10.0.0.1:8000,[fd00::3]:8000,10.0.0.2:8000"
    assert address(c) == "[fd00::3]:8000"


def test_cache_aware_picks_the_endpoint_holding_the_prefix_and_counts_its_pending_tokens():
    pool, (a, b) = pool_of("10.0.0.1:8000", "10.0.0.2:8000", policy=Policy.CACHE_AWARE)
    system = list(range(100, 164))
    log = EventLog(PAGE, "m")
    log.apply(0, [("stored", page_hashes(system, PAGE))])
    pool.kv_index.of(b.url).apply(log.since("", -1), time.monotonic())
    ids = system + [1, 2, 3]
    picker = Picker(pool)
    choice = picker.choose(Prompt(len(ids), page_hashes(ids, PAGE), PAGE))
    assert choice.worker is b and choice.tokens == 3 and b.pending_tokens == 3 and b.inflight == 1
    picker.prefilled(choice)
    picker.done(choice)
    assert (b.pending_tokens, b.inflight) == (0, 0)


def headers(path: str, end: bool = False) -> pb.ProcessingRequest:
    m = core.HeaderMap(headers=[core.HeaderValue(key=":path", raw_value=path.encode())])
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=m, end_of_stream=end))


def body(data: bytes, end: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end))


def exchange(pool: WorkerPool, **picker) -> Exchange:
    return Exchange(Picker(pool, **picker), Reader("m"), EppMetrics())


def run(x: Exchange, *reqs: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
    async def go():
        return [a for r in reqs for a in await x.answer(r)]

    return asyncio.run(go())


def test_a_request_is_answered_at_its_body_end_with_the_header_the_metadata_and_its_body():
    pool, (a,) = pool_of("10.0.0.1:8000")
    x = exchange(pool)
    raw = json.dumps(CHAT).encode()
    assert run(x, headers("/v1/chat/completions?x=1"), body(raw[:10], False)) == []
    out = run(x, body(raw[10:], True))
    assert [o.WhichOneof("response") for o in out] == ["request_headers", "request_body"]
    common = out[0].request_headers.response
    set_headers = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    assert set_headers == {answers.DESTINATION: "10.0.0.1:8000", "content-length": str(len(raw))}
    assert common.clear_route_cache
    lb = out[0].dynamic_metadata.fields[answers.LB].struct_value.fields
    assert lb[answers.DESTINATION].string_value == "10.0.0.1:8000"
    streamed = out[1].request_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (raw, True)
    assert a.inflight == 1
    x.close()
    assert a.inflight == 0


def test_a_buffered_body_gets_its_headers_answered_at_once_and_the_pick_answers_the_body():
    pool, (a,) = pool_of("10.0.0.1:8000")
    x = exchange(pool)
    first = headers("/v1/chat/completions")
    first.protocol_config.request_body_mode = ProcessingMode.BUFFERED
    (h,) = run(x, first)
    assert h.WhichOneof("response") == "request_headers" and not h.request_headers.response.header_mutation.set_headers
    (out,) = run(x, body(json.dumps(CHAT).encode(), True))
    common = out.request_body.response
    assert [h.header.raw_value for h in common.header_mutation.set_headers] == [b"10.0.0.1:8000"]
    assert common.clear_route_cache and not common.HasField("body_mutation")
    assert (
        out.dynamic_metadata.fields[answers.LB].struct_value.fields[answers.DESTINATION].string_value == "10.0.0.1:8000"
    )


def test_a_request_without_a_body_is_picked_at_its_headers():
    pool, _ = pool_of("10.0.0.1:8000")
    (out,) = run(exchange(pool), headers("/v1/models", end=True))
    assert out.request_headers.response.header_mutation.set_headers[0].header.raw_value == b"10.0.0.1:8000"


def test_under_dp_attention_the_group_is_named_in_the_body():
    pool, (a,) = pool_of("10.0.0.1:8000")
    a.report = {"dp_loads": [3, 0]}
    out = run(exchange(pool), headers("/v1/chat/completions"), body(json.dumps(CHAT).encode(), True))
    sent = json.loads(out[1].request_body.response.body_mutation.streamed_response.body)
    assert sent == {**CHAT, "data_parallel_rank": 1}


@pytest.mark.parametrize(
    "raw, limit, status, param",
    [
        (b'{"model": "m", "messages": "x"}', 0, 400, "messages"),
        (b"[1, 2]", 0, 400, None),
        (json.dumps(CHAT).encode(), 20, 413, None),
    ],
)
def test_a_refusal_is_an_immediate_response_with_the_openai_error_body(raw, limit, status, param):
    pool, (a,) = pool_of("10.0.0.1:8000")
    x = exchange(pool, max_body_bytes=limit)
    (out,) = run(x, headers("/v1/chat/completions"), body(raw, True))
    immediate = out.immediate_response
    assert immediate.status.code == status
    error = json.loads(immediate.body)["error"]
    assert error["param"] == param and error["message"]
    assert {h.header.key for h in immediate.headers.set_headers} == {"content-type"}
    assert a.inflight == 0


def test_a_shed_request_says_when_to_retry():
    pool, (a,) = pool_of("10.0.0.1:8000")
    a.inflight = 2
    (out,) = run(exchange(pool, max_queue=2), headers("/v1/models", end=True))
    assert out.immediate_response.status.code == 429
    retry = {h.header.key: h.header.raw_value for h in out.immediate_response.headers.set_headers}["retry-after"]
    assert retry == b"1"


def test_the_served_endpoint_is_read_from_the_metadata_or_the_response_header():
    pool, (a,) = pool_of("10.0.0.1:8000")
    metrics = EppMetrics()
    x = Exchange(Picker(pool), Reader("m"), metrics)
    run(x, headers("/v1/models", end=True))
    m = core.HeaderMap(headers=[core.HeaderValue(key=answers.SERVED, raw_value=b"10.0.0.1:8000")])
    (out,) = run(x, pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=m)))
    assert out.WhichOneof("response") == "response_headers"
    assert (
        metrics.registry.get_sample_value("disagg_epp_served_total", {"endpoint": "10.0.0.1:8000", "as_picked": "true"})
        == 1
    )
    req = pb.ProcessingRequest()
    req.metadata_context.filter_metadata[answers.LB].fields[answers.SERVED].string_value = "10.0.0.9:1"
    assert answers.served_of(req, {answers.SERVED: "other"}) == "10.0.0.9:1"
