"""The Responses API (`/v1/responses`) and /tokenize, /detokenize with today's client libraries, monolithic and
through router -> prefill -> decode, on the tiny model given a Hermes-style chat template (its answers are
gibberish: what is checked is the shape, the constraints, the round trips and P/D == monolithic).

The official `openai` client's `responses.create` plain, streamed, with a JSON-schema format, with a function
tool and the tool's output sent back, with `previous_response_id` (the router's store); the OpenAI Agents SDK
with its default Responses model runs an agent loop with a function tool to completion through P/D.
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest
import requests

from disagg_worker.model.tokenizer import Tokenizer
from tests.integration.procs import PDStack, scaled, serve
from tests.integration.test_tools import hermes_model  # noqa: F401  (the tiny model with a tool-calling template)

pytestmark = pytest.mark.integration
FLAGS = ("--page-size", "4", "--max-total-tokens", "8192", "--served-model-name", "tiny")
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": CITY}


@pytest.fixture(scope="module")
def servers(hermes_model):  # noqa: F811
    mono = serve(hermes_model, *FLAGS)
    stack = PDStack(hermes_model, *FLAGS)
    for p in (mono, stack):
        p.wait_healthy()
    yield {"mono": mono.url, "pd": stack.router.url}
    for p in (mono, stack):
        p.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=scaled(60))


def test_tokenize_and_detokenize_answer_as_vllm_does(servers, hermes_model):  # noqa: F811
    tok = Tokenizer.from_path(hermes_model)
    chat = [{"role": "user", "content": "Hello there"}]
    for url in servers.values():
        r = requests.post(f"{url}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
        assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
        assert r["max_model_len"] > 0 and len(r["token_strs"]) == r["count"]
        r = requests.post(f"{url}/tokenize", json={"messages": chat}).json()
        assert r["tokens"] == tok.encode(tok.apply_chat_template(chat, True), add_special_tokens=False)
        assert requests.post(f"{url}/detokenize", json={"tokens": tok.encode("Hello world")}).json() == {
            "prompt": tok.decode(tok.encode("Hello world"))
        }
        bad = requests.post(f"{url}/detokenize", json={"tokens": [-1]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_a_plain_response_monolithic_and_pd_alike(servers):
    got = {}
    for side, url in servers.items():
        r = client(url).responses.create(
            model="tiny", input="Say hi", instructions="Be brief.", max_output_tokens=8, temperature=0
        )
        assert (
            r.id.startswith("resp_") and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        )
        assert r.output[0].type == "message" and r.output_text
        assert r.usage.output_tokens == 8 and r.usage.input_tokens > 0
        assert r.usage.total_tokens == r.usage.input_tokens + 8
        got[side] = r.output_text
    assert got["pd"] == got["mono"]


def test_a_streamed_response_sends_the_event_sequence_and_the_whole_text(servers):
    for url in servers.values():
        whole = client(url).responses.create(model="tiny", input="Say hi", max_output_tokens=8, temperature=0)
        events = list(
            client(url).responses.create(model="tiny", input="Say hi", max_output_tokens=8, temperature=0, stream=True)
        )
        kinds = [e.type for e in events]
        assert kinds[:4] == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
        ]
        assert kinds[-4:] == [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete",
        ]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == whole.output_text == events[-1].response.output_text
        assert events[-1].response.usage.output_tokens == 8


def test_a_json_schema_format_constrains_the_text(servers):
    fmt = {"type": "json_schema", "name": "weather", "schema": CITY, "strict": True}
    for url in servers.values():
        r = client(url).responses.create(model="tiny", input="Weather?", text={"format": fmt}, max_output_tokens=200)
        assert r.status == "completed"
        jsonschema.validate(json.loads(r.output_text), CITY)


def test_a_forced_function_call_and_its_output_sent_back(servers):
    for side, url in servers.items():
        c = client(url)
        first = c.responses.create(
            model="tiny", input="Weather in Oslo?", tools=[WEATHER], tool_choice="required", max_output_tokens=200
        )
        call = first.output[-1]
        assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), CITY)
        history = [
            {"role": "user", "content": "Weather in Oslo?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 3}'},
        ]
        second = c.responses.create(model="tiny", input=history, tools=[WEATHER], max_output_tokens=6, temperature=0)
        assert second.output[0].type == "message" and second.output_text
        assert second.usage.input_tokens > first.usage.input_tokens, side


def test_a_streamed_function_call_comes_as_argument_events(servers):
    named = {"type": "function", "name": "get_weather"}
    for url in servers.values():
        events = list(
            client(url).responses.create(
                model="tiny", input="Oslo?", tools=[WEATHER], tool_choice=named, max_output_tokens=200, stream=True
            )
        )
        kinds = [e.type for e in events]
        assert "response.output_text.delta" not in kinds and kinds[-1] == "response.completed"
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        done = next(e for e in events if e.type == "response.function_call_arguments.done")
        assert done.arguments == args == events[-1].response.output[0].arguments
        jsonschema.validate(json.loads(args), CITY)


def test_previous_response_id_continues_the_conversation_and_the_store_answers_get_and_delete(servers):
    for side, url in servers.items():
        c = client(url)
        first = c.responses.create(model="tiny", input="Remember 7.", max_output_tokens=4, temperature=0)
        second = c.responses.create(
            model="tiny", input="What was it?", previous_response_id=first.id, max_output_tokens=4, temperature=0
        )
        alone = c.responses.create(model="tiny", input="What was it?", max_output_tokens=4, temperature=0)
        assert second.previous_response_id == first.id
        assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.input_tokens - 4, side
        assert c.responses.retrieve(first.id).output_text == first.output_text
        c.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError) as e:
            c.responses.create(model="tiny", input="Again?", previous_response_id=first.id, max_output_tokens=2)
        assert e.value.body["param"] == "previous_response_id"
        unstored = c.responses.create(model="tiny", input="Hi", store=False, max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(unstored.id)


def test_bad_input_is_a_400_naming_the_field(servers):
    for url in servers.values():
        for body, param in (
            ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
            ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
            ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
            ({"input": 3}, "input"),
        ):
            r = requests.post(f"{url}/v1/responses", json={"model": "tiny", **body}, timeout=scaled(30))
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == param


class Forecast(pydantic.BaseModel):
    sky: Literal["rain", "sun"]


def test_the_agents_sdk_runs_an_agent_loop_with_a_function_tool_through_pd(servers):
    agents = pytest.importorskip("agents")
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Oslo", "Paris"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return "3 degrees and rain"

    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(openai.AsyncOpenAI(base_url=f"{servers['pd']}/v1", api_key="unused"))
    # The first turn must call the tool (the random model never would); the SDK then resets the choice to auto,
    # and the structured output type (a JSON schema format) makes the random model's last answer end by itself.
    settings = agents.ModelSettings(tool_choice="required", max_tokens=300, temperature=0)
    agent = agents.Agent(
        name="weather",
        instructions="Answer.",
        tools=[get_weather],
        model="tiny",
        model_settings=settings,
        output_type=Forecast,
    )
    result = asyncio.run(agents.Runner.run(agent, "Weather in Oslo?", max_turns=4))
    assert len(calls) == 1 and isinstance(result.final_output, Forecast)
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
