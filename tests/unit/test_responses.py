"""The Responses API's pure parts: a request read as its chat (fields renamed in errors), the store's
bounds, and the stream's events in OpenAI's order adding up to the whole response."""

from __future__ import annotations

import json

import pytest

from disagg_worker.request.errors import APIError
from disagg_worker.request.limits import RequestLimits
from disagg_worker.server import responses_format as rf
from disagg_worker.server.response_store import ResponseStore
from disagg_worker.server.responses_input import input_items, parse_responses, to_chat_body

LIMITS = RequestLimits(max_context_len=4096, vocab_size=1000)
TOOL = {"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {}}}


def chat_of(body: dict) -> dict:
    return to_chat_body(body, input_items(body))


def test_input_items_become_chat_messages():
    items = [
        {
            "role": "developer",
            "content": [{"type": "input_text", "text": "Be "}, {"type": "input_text", "text": "brief"}],
        },
        {"role": "user", "content": "Oslo?"},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": "{}"},
        {"type": "reasoning", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "3C"},
    ]
    chat = chat_of({"input": items, "instructions": "Answer.", "max_output_tokens": 9, "tools": [TOOL]})
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["system", "system", "user", "assistant", "tool"]
    assert chat["messages"][1]["content"] == "Be brief" and chat["max_tokens"] == 9
    assert [c["id"] for c in chat["messages"][3]["tool_calls"]] == ["c1", "c2"]
    assert chat["messages"][4] == {"role": "tool", "tool_call_id": "c1", "content": "3C"}
    assert chat["tools"] == [{"type": "function", "function": {"name": "weather", "parameters": TOOL["parameters"]}}]


def test_text_format_and_tool_choice_as_chat_has_them():
    schema = {"type": "object"}
    chat = chat_of({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": schema}}})
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    named = chat_of({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "weather"}})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    forced = chat_of(
        {"input": "x", "tools": [TOOL], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}
    )
    assert "response_format" not in forced  # a forced call writes no text to format


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": [{"type": "input_image"}]}, "input[0].type"),
        ({"input": [{"role": "critic", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input[0].content[0]"),
        ({"input": "x", "tools": [{"type": "file_search"}]}, "tools[0].type"),
        ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
        ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"input": "x", "temperature": "hot"}, "temperature"),
    ],
)
def test_bad_fields_are_a_400_named_as_the_responses_api_names_them(body, param):
    with pytest.raises(APIError) as e:
        parse_responses(body, input_items(body), "m", LIMITS)
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert param.split("[")[0] in e.value.message


def test_the_store_is_bounded_by_size_and_age_and_honours_store_false():
    now = [0.0]
    store = ResponseStore(max_entries=2, max_age_s=10, clock=lambda: now[0])
    for i in range(3):
        store.put({"id": f"r{i}", "output": [{"type": "message", "n": i}]}, [{"role": "user", "content": str(i)}])
    assert len(store) == 2
    with pytest.raises(APIError) as e:
        store.continued({"previous_response_id": "r0"})
    assert e.value.status == 404 and e.value.param == "previous_response_id"
    assert store.continued({"previous_response_id": "r2"}) == [
        {"role": "user", "content": "2"},
        {"type": "message", "n": 2},
    ]
    store.put({"id": "r3", "store": False, "output": []}, [])
    with pytest.raises(APIError):
        store.get("r3")
    now[0] = 11
    assert len(store) == 0
    with pytest.raises(APIError) as e:
        store.get("r2")
    assert e.value.status == 404 and e.value.param is None


def test_streamed_events_come_in_order_and_add_up_to_the_whole_response():
    head = rf.ResponseHead("resp_1", "m", {"input": "x"})
    events = rf.ResponseEvents(head)
    call = {"id": "call_ab", "type": "function", "function": {"name": "weather", "arguments": '{"a": 1}'}}
    raw = events.start() + events.delta("Hel") + events.delta("") + events.delta("lo")
    closing, response = events.finish([call], "stop", rf.usage(5, 3, 0))
    parsed = [json.loads(e.split(b"\ndata: ")[1]) for e in (raw + closing).split(b"\n\n") if e]
    kinds = [p["type"] for p in parsed]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [p["sequence_number"] for p in parsed] == list(range(len(parsed)))
    assert parsed[-1]["response"] == response and response["status"] == "completed"
    message, fn = response["output"]
    assert message["content"][0]["text"] == "Hello" and fn["call_id"] == "call_ab" and fn["arguments"] == '{"a": 1}'
    assert response["usage"]["total_tokens"] == 8


def test_the_store_is_bounded_in_bytes_whatever_the_bodies_carry():
    """300 answers each carrying ~1 MB of metadata stay under the byte bound; the newest are the ones kept, and
    one answer alone over the bound is not kept at all."""
    bound = 8 * 1024 * 1024
    store = ResponseStore(max_entries=1000, max_bytes=bound)
    big = "x" * (1024 * 1024)
    for i in range(300):
        store.put({"id": f"r{i}", "metadata": {"note": big}, "output": []}, [{"role": "user", "content": "hi"}])
        assert store.nbytes <= bound
    assert 0 < len(store) <= 8 and store.get("r299").response["metadata"]["note"] == big
    with pytest.raises(APIError):
        store.get("r0")
    store.put({"id": "huge", "metadata": {"note": "x" * (bound + 1)}, "output": []}, [])
    with pytest.raises(APIError):
        store.get("huge")
    assert store.get("r299") and store.nbytes <= bound


def test_a_stored_response_is_its_callers_and_a_404_to_any_other():
    store = ResponseStore()
    store.put({"id": "mine", "output": [{"type": "message", "n": 1}]}, [{"role": "user", "content": "a"}], "key-a")
    for attempt in (
        lambda: store.get("mine", owner="key-b"),
        lambda: store.continued({"previous_response_id": "mine"}, "key-b"),
        lambda: store.delete("mine", "key-b"),
        lambda: store.get("mine"),  # a caller without a key is another caller too
    ):
        with pytest.raises(APIError) as e:
            attempt()
        assert e.value.status == 404
    assert store.get("mine", owner="key-a").response["id"] == "mine"
    assert store.delete("mine", "key-a")["deleted"] is True
