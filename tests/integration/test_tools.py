"""Tool calling with the official `openai` client, monolithic and through router -> prefill -> decode, on
the tiny model given a Hermes-style (Qwen2.5/Qwen3) chat template. The random model never calls a tool
on its own, so what is checked end to end is the forced call ("required" and a named function), the
answer's shape, P/D == monolithic, streaming, the second turn, a forced call on a template without tools
(the tools written into the prompt) and the refusal of "auto" there; `tests/unit/test_tool_calls.py` checks
the parsing of free answers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.integration.procs import PDStack, scaled, serve

pytestmark = pytest.mark.integration
FLAGS = ("--page-size", "4", "--max-total-tokens", "8192", "--served-model-name", "tiny")
TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "chat_templates" / "hermes.jinja"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def hermes_model(tiny_model, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tiny-hermes") / "model"
    shutil.copytree(tiny_model, out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATE.read_text()
    cfg_path.write_text(json.dumps(cfg))
    return str(out)


@pytest.fixture(scope="module")
def servers(hermes_model, tiny_model):
    mono = serve(hermes_model, *FLAGS)
    stack = PDStack(hermes_model, *FLAGS)
    plain = serve(tiny_model, *FLAGS)  # the tiny model's own template has no tools
    for p in (mono, stack, plain):
        p.wait_healthy()
    yield {"mono": mono.url, "pd": stack.router.url, "plain": plain.url}
    for p in (mono, stack, plain):
        p.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=scaled(60))


def call(url: str, **kw):
    return client(url).chat.completions.create(model="tiny", messages=kw.pop("messages", ASK), tools=TOOLS, **kw)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_is_a_tool_call_monolithic_and_pd_alike(servers, choice):
    got = {}
    for side in ("mono", "pd"):
        r = call(servers[side], tool_choice=choice, max_tokens=200, temperature=0)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        assert c.message.content is None and len(c.message.tool_calls) == 1
        tc = c.message.tool_calls[0]
        assert tc.type == "function" and tc.id.startswith("call_")
        name, args = calls_of(c.message)[0]
        assert name in ("get_weather", "get_time") if choice == "required" else name == "get_weather"
        jsonschema.validate(args, TOOLS[0 if name == "get_weather" else 1]["function"]["parameters"])
        got[side] = calls_of(c.message)
    assert got["pd"] == got["mono"]


def test_streamed_calls_accumulate_to_the_whole_answer(servers):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for side in ("mono", "pd"):
        whole = call(servers[side], tool_choice=choice, max_tokens=200, temperature=1, seed=5)
        chunks = list(call(servers[side], tool_choice=choice, max_tokens=200, temperature=1, seed=5, stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert content == "" and finish == ["tool_calls"]
        assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
            (0, *calls_of(whole.choices[0].message)[0])
        ]


def test_the_second_turn_sends_the_call_and_its_result_back(servers):
    first = call(servers["pd"], tool_choice="required", max_tokens=200, temperature=0).choices[0].message
    history = [
        *ASK,
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": '{"temperature": 3}'},
    ]
    for side in ("mono", "pd"):
        r = call(servers[side], messages=history, tool_choice="none", max_tokens=8, temperature=0)
        assert r.choices[0].message.tool_calls is None and r.choices[0].message.content is not None
        assert r.usage.prompt_tokens > call(servers[side], tool_choice="none", max_tokens=1).usage.prompt_tokens


def test_auto_offers_the_tools_and_answers_text_when_the_model_calls_none(servers):
    for side in ("mono", "pd"):
        offered = call(servers[side], max_tokens=6, temperature=0)
        plain = call(servers[side], tool_choice="none", max_tokens=6, temperature=0)
        assert offered.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools are in the prompt
        assert offered.choices[0].finish_reason in ("length", "stop") and offered.choices[0].message.content


def test_a_model_whose_template_has_no_tools_refuses_auto_naming_tools(servers):
    with pytest.raises(openai.BadRequestError) as e:
        call(servers["plain"], max_tokens=4)
    assert "tools" in e.value.message and "chat template" in e.value.message


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_needs_no_template_support(servers, choice):
    """The tools go into the prompt as text; the call's arguments still follow the function's schema."""
    r = call(servers["plain"], tool_choice=choice, max_tokens=200, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    name, args = calls_of(c.message)[0]
    assert name == "get_weather" or choice == "required"
    jsonschema.validate(args, TOOLS[0 if name == "get_weather" else 1]["function"]["parameters"])
    plain = call(servers["plain"], tool_choice="none", max_tokens=1)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools are in the prompt
    with pytest.raises(openai.BadRequestError) as e:
        call(servers["mono"], tool_choice="required", response_format={"type": "json_object"}, max_tokens=4)
    assert "tool_choice" in e.value.message
