"""Through P/D, echoed prompt logprobs come from prefill's answer: the router puts them into decode's answer or
the first event of decode's stream; a Responses stream's final response is what the router stores."""

from __future__ import annotations

import asyncio
import json

from disagg_worker.router.attempt import Attempt, Opened
from disagg_worker.router.echo import with_prompt_logprobs
from disagg_worker.router.responses import _final
from disagg_worker.router.worker import Worker

PREFILL = {
    "choices": [
        {
            "logprobs": {
                "token_logprobs": [None, -1.5, -2.5, -0.5],
                "top_logprobs": [None, {"a": -1}, {"b": -2}, {"c": -3}],
            }
        }
    ],
    "usage": {"prompt_tokens": 3},
}


def decode_choice() -> dict:
    return {"text": "abcd", "logprobs": {"token_logprobs": [None, None, None, -0.25], "top_logprobs": [None] * 4}}


def opened(first: bytes) -> Opened:
    async def prefill() -> Attempt:
        return Attempt(200, PREFILL)

    async def run() -> Opened:
        o = Opened(None, first, asyncio.ensure_future(prefill()), Worker("http://d", "decode"))  # type: ignore[arg-type]
        await with_prompt_logprobs(o, 5)
        return o

    return asyncio.run(run())


def test_decode_answer_gets_prefill_prompt_logprobs_and_keeps_its_own():
    o = opened(json.dumps({"choices": [decode_choice()]}).encode())
    lps = json.loads(o.first)["choices"][0]["logprobs"]
    assert lps["token_logprobs"] == [None, -1.5, -2.5, -0.25]
    assert lps["top_logprobs"] == [None, {"a": -1}, {"b": -2}, None]


def test_a_stream_first_event_gets_them_and_the_rest_is_untouched():
    rest = b'data: {"choices": []}\n\n'
    o = opened(b"data: " + json.dumps({"choices": [decode_choice()]}).encode() + b"\n\n" + rest)
    head, _, tail = o.first.partition(b"\n\n")
    assert json.loads(head[6:])["choices"][0]["logprobs"]["token_logprobs"][:3] == [None, -1.5, -2.5]
    assert tail == rest


def test_the_final_response_of_a_responses_stream_is_kept():
    kept: list[dict] = []
    events = (
        b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta"}\n\n'
        b'event: response.completed\ndata: {"type": "response.completed", "response": {"id": "resp_1"}}\n\n'
        b"data: [DONE]\n\n"
    )
    _final(events, kept.append)
    assert kept == [{"id": "resp_1"}]
