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


def test_echo_logprobs_are_bounded_by_prompt_tokens_times_alternatives_times_choices():
    import pytest

    from disagg_worker.request.errors import APIError
    from disagg_worker.request.limits import ECHO_LOGPROBS_PARAM, check_echo_logprobs
    from disagg_worker.tuning import TUNING

    bound = TUNING.request.echo_logprob_entries
    check_echo_logprobs(bound // 8, 7, 1)  # exactly at the bound: 32768 tokens x 8 x 1
    check_echo_logprobs(10**9, None, 16)  # no logprobs: nothing scored
    with pytest.raises(APIError) as e:
        check_echo_logprobs(3000, 5, 16)
    assert (e.value.status, e.value.param) == (400, ECHO_LOGPROBS_PARAM) == (400, "echo, logprobs, n")
    assert "3000 prompt tokens x (logprobs 5 + 1) x n 16 = 288000 entries" in e.value.message


def test_the_router_counts_the_prompt_before_any_worker_sees_it():
    import pytest

    from disagg_worker.request.errors import APIError
    from disagg_worker.router.echo import check_echo_bound

    def refused(body: dict, tokens=None) -> str | None:
        try:
            check_echo_bound("/v1/completions", body, tokens)
        except APIError as e:
            assert e.status == 400 and e.param == "echo, logprobs, n"
            return e.message
        return None

    long_ids, echo = [7] * 3000, {"echo": True, "logprobs": 5}
    assert "3000 prompt tokens" in (refused({**echo, "n": 16, "prompt": long_ids}) or "")
    assert refused({**echo, "n": 1, "prompt": long_ids}) is None
    assert "6000 prompt tokens" in (refused({**echo, "n": 8, "prompt": [long_ids, long_ids]}) or "")  # a batch sums
    assert refused({"logprobs": 5, "n": 16, "prompt": long_ids}) is None  # no echo: no prompt logprobs
    assert refused({**echo, "n": 16, "prompt": long_ids, "logprobs": "5"}) is None  # the worker's 400 names it
    text = "é" * 1500  # 3000 UTF-8 bytes: without a tokenizer, the most tokens it can be
    assert "a text prompt's UTF-8 bytes" in (refused({**echo, "n": 16, "prompt": text}) or "")
    assert refused({**echo, "n": 1, "prompt": text * 100}) is None  # one choice: its workers count it exactly

    class Tokens:
        class tokenizer:  # noqa: N801 - stands in for PromptTokens.tokenizer
            @staticmethod
            def encode(text: str) -> list[int]:
                return [1] * (len(text) // 4)

    assert refused({**echo, "n": 16, "prompt": text}, Tokens()) is None  # 375 tokens counted by the tokenizer
    with pytest.raises(APIError):
        check_echo_bound("/v1/completions", {**echo, "n": 16, "prompt": text * 10}, Tokens())  # type: ignore[arg-type]
