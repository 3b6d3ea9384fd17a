"""The router's body sharing and stream relaying, in one process (real sockets for the upstream)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from disagg_worker.request.errors import APIError, bad_request
from disagg_worker.router.batch import as_batch_prompt, prompt_bodies
from disagg_worker.router.fanout import CHOICE_EVENTS, Merger, merge_bodies, stream_merged
from disagg_worker.router.payload import WRITE_SLICE, SharedBody
from disagg_worker.router.stream import DONE, UpstreamLost, choice_events, relay


class Sink:
    """Collects what a payload or a relay writes."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    async def write(self, data) -> None:
        self.parts.append(bytes(data))

    @property
    def data(self) -> bytes:
        return b"".join(self.parts)


def written(payload) -> bytes:
    sink = Sink()
    asyncio.run(payload.write(sink))
    assert len(sink.data) == payload.size
    return sink.data


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "x" * 600_000, "n": 4, "seed": 7, "stream": True, "temperature": 1.0},
        {"messages": [{"role": "user", "content": "\u4e00 hi"}], "max_tokens": 3},
        {},
        {"prompt": "\ud800 lone surrogate"},
    ],
)
def test_every_choice_gets_the_body_with_its_own_fields(body):
    shared = SharedBody.of(body)
    payloads = [shared.payload(n=1, seed=i, bootstrap_room=100 + i) for i in range(4)]
    for i, p in enumerate(payloads):
        got = json.loads(written(p))
        assert got == {**body, "n": 1, "seed": i, "bootstrap_room": 100 + i}
    assert all(p.shared is payloads[0].shared for p in payloads), "the choices share one serialised copy"


def test_a_large_body_is_written_in_slices_of_the_shared_buffer():
    p = SharedBody.of({"prompt": "y" * (3 * WRITE_SLICE)}).payload(stream=False)
    sink = Sink()
    asyncio.run(p.write(sink))
    assert max(len(part) for part in sink.parts) <= WRITE_SLICE
    assert json.loads(sink.data)["stream"] is False


def upstream_app(events: list[bytes], then: str) -> web.Application:
    """Streams `events`, then ends: "done" sends [DONE], "eof" ends cleanly without it, "drop" cuts the socket."""

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for e in events:
            await resp.write(e)
        if then == "done":
            await resp.write(DONE)
        elif then == "drop":
            await asyncio.sleep(0.05)
            assert request.transport is not None
            request.transport.abort()
        return resp

    app = web.Application()
    app.router.add_get("/", stream)
    return app


EVENTS = [b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n', b'data: {"choices": [{"index": 0, "text": "b"}]}\n\n']


async def relay_from(then: str) -> tuple[bytes, str]:
    async with TestServer(upstream_app(EVENTS, then)) as srv, aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{srv.port}/") as resp:
            sink = Sink()
            try:
                await relay(sink, b"", resp)
            except UpstreamLost as e:
                return sink.data, e.message
            return sink.data, ""


@pytest.mark.parametrize("then", ["eof", "drop"])
def test_a_stream_that_ends_without_done_is_lost(then):
    data, lost = asyncio.run(relay_from(then))
    assert data == b"".join(EVENTS), "every complete event was passed on"
    assert "incomplete" in lost


def test_a_complete_stream_is_passed_on_whole():
    data, lost = asyncio.run(relay_from("done"))
    assert data == b"".join(EVENTS) + DONE and lost == ""


def test_choice_events_stop_at_done_and_fail_without_it():
    async def events(then: str):
        async with TestServer(upstream_app(EVENTS, then)) as srv, aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{srv.port}/") as resp:
                got = []
                try:
                    async for e in choice_events(b"", resp):
                        got.append(e["choices"][0]["text"])
                except UpstreamLost:
                    return got, True
                return got, False

    assert asyncio.run(events("done")) == (["a", "b"], False)
    assert asyncio.run(events("drop")) == (["a", "b"], True)


def test_merger_relabels_choices_and_sums_usage():
    m = Merger(per_prompt=4)
    a = m.relabel(2, {"id": "cmpl-a", "choices": [{"index": 0, "text": "x"}]})
    b = m.relabel(3, {"id": "cmpl-b", "choices": [{"index": 0, "text": "y"}]})
    assert a is not None and b is not None
    assert (a["choices"][0]["index"], b["choices"][0]["index"], b["id"]) == (2, 3, "cmpl-a")
    for n in (4, 5):
        assert m.relabel(0, {"id": "u", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}}) is None
    usage = m.usage_event()
    assert usage is not None and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}
    err = m.relabel(1, {"error": {"message": "KV transfer failed", "type": "server_error"}})
    assert err is not None and err["error"]["message"] == "Choice 1: KV transfer failed"


def usage_event(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"id": "u", "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}}


def test_a_batch_stream_counts_each_prompts_tokens_once_and_every_choices_output():
    m = Merger(per_prompt=2)  # choices 0, 1: a prompt of 3 tokens; 2, 3: one of 5; 4, 5: one of 7
    for i, (prompt, out) in enumerate([(3, 4), (3, 2), (5, 1), (5, 6), (7, 3), (7, 3)]):
        assert m.relabel(i, usage_event(prompt, out)) is None
    usage = m.usage_event()
    assert usage is not None and usage["usage"] == {"prompt_tokens": 15, "completion_tokens": 19, "total_tokens": 34}


def test_merged_batch_bodies_are_indexed_in_order_and_sum_each_prompt_once():
    def body(text: str, prompt: int, out: int) -> dict:
        choice = {"index": 0, "text": text, "finish_reason": "length"}
        usage = {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}
        return {"id": f"cmpl-{text}", "object": "text_completion", "choices": [choice], "usage": usage}

    merged = merge_bodies([body("a", 3, 4), body("b", 3, 2), body("c", 5, 1), body("d", 5, 6)], per_prompt=2)
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "a"), (1, "b"), (2, "c"), (3, "d")]
    assert merged["id"] == "cmpl-a"
    assert merged["usage"] == {"prompt_tokens": 8, "completion_tokens": 13, "total_tokens": 21}
    one = merge_bodies([body("a", 3, 4), body("b", 3, 2)], per_prompt=2)  # n = 2 of one prompt: as before
    assert one["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}


def test_the_router_splits_a_completions_batch_as_the_workers_do():
    body = {"model": "m", "prompt": ["one", [5, 6], "three"], "n": 2, "temperature": 0}
    assert prompt_bodies("/v1/completions", body) == [
        {"model": "m", "prompt": "one", "n": 2, "temperature": 0},
        {"model": "m", "prompt": [5, 6], "n": 2, "temperature": 0},
        {"model": "m", "prompt": "three", "n": 2, "temperature": 0},
    ]
    for one in ({"prompt": "x"}, {"prompt": [5, 6]}, {"prompt": ["x"]}, {"prompt": [[5, 6]]}):
        assert prompt_bodies("/v1/completions", one) == [one]
    assert prompt_bodies("/v1/chat/completions", {"prompt": ["a", "b"]}) == [{"prompt": ["a", "b"]}]
    bad_n = {"prompt": ["a", "b"], "n": 0}  # left whole: the worker's 400 names n
    assert prompt_bodies("/v1/completions", bad_n) == [bad_n]
    with pytest.raises(APIError) as e:
        prompt_bodies("/v1/completions", {"prompt": ["a"] * 9, "n": 16})
    assert (e.value.status, e.value.param) == (400, "prompt") and "144 choices" in e.value.message


def test_a_batch_element_that_is_itself_a_batch_is_refused_naming_it():
    """Sent on alone, `["0", "0"]` would be read as a batch of two prompts, not as prompt 0 of this batch (a worker
    refuses it in the batch): the router refuses it before any pair is picked."""
    for element in (["0", "0"], [[5], [6]], [5, True]):
        with pytest.raises(APIError) as e:
            prompt_bodies("/v1/completions", {"prompt": ["fine", element], "max_tokens": 2})
        assert (e.value.status, e.value.param) == (400, "prompt[1]")


def test_a_batch_prompts_own_error_names_it_as_a_worker_does():
    e = as_batch_prompt(bad_request("prompt: must not be empty", "prompt"), 2)
    assert isinstance(e, APIError) and (e.status, e.param, e.message) == (
        400,
        "prompt[2]",
        "prompt[2]: must not be empty",
    )
    other = bad_request("temperature: too hot", "temperature")
    assert as_batch_prompt(other, 2) is other


def test_a_client_that_stops_reading_holds_each_choices_upstream_back_to_a_bounded_queue():
    """n streams merged for a client that reads nothing: each choice's upstream is read only `CHOICE_EVENTS`
    ahead of what was written, not to its end; once the client reads, every event arrives, then [DONE]."""
    events_per_choice, read = 10 * CHOICE_EVENTS, [0, 0]

    async def upstream(i: int):
        for k in range(events_per_choice):
            read[i] += 1
            yield {"id": f"r{i}", "choices": [{"index": 0, "text": f"{i}:{k}"}]}

    class Client:
        def __init__(self) -> None:
            self.reading = asyncio.Event()
            self.written: list[bytes] = []

        async def write(self, data: bytes) -> None:
            await self.reading.wait()
            self.written.append(data)

    async def go() -> Client:
        client = Client()
        merged = asyncio.create_task(stream_merged(client, [upstream(0), upstream(1)], 2))  # type: ignore[arg-type]
        for _ in range(50):
            await asyncio.sleep(0)
        held = list(read)
        client.reading.set()
        await merged
        assert all(n <= CHOICE_EVENTS + 1 for n in held), held
        return client

    client = asyncio.run(go())
    assert client.written[-1] == b"data: [DONE]\n\n"
    texts = [json.loads(w[6:])["choices"][0] for w in client.written[:-1]]
    for i in (0, 1):
        assert [c["text"] for c in texts if c["index"] == i] == [f"{i}:{k}" for k in range(events_per_choice)]
