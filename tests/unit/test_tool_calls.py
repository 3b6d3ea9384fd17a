"""Tool calling: requests refused with the param named, the template's call format, calls parsed out of
answers (and kept as text when malformed), streamed answers giving the same calls, and the forcing
grammar giving a valid call whatever the logits."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_worker.engine.grammar import Grammars
from disagg_worker.engine.sampling import Sampler
from disagg_worker.model.tokenizer import Tokenizer, _compile
from disagg_worker.request.errors import APIError
from disagg_worker.server.tool_calls import (
    HERMES,
    LLAMA3,
    ChatTools,
    ToolStream,
    parse_calls,
    parse_tool_use,
    template_style,
)
from tests.unit.test_grammar import constrained, run
from tests.unit.test_protocol import USER, chat, error

pytest_plugins = ["tests.unit.conftest_model"]
TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "time", "parameters": {"type": "object", "properties": {}}}},
]
NAMES = frozenset({"weather", "time"})


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": "weather"}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"functions": [TOOLS[0]["function"]]}, "functions"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_malformed_tool_requests_are_a_400_naming_the_param(body, param):
    e = error(chat, {"messages": USER, **body})
    assert (e.status, e.param) == (400, param), e.message


def test_tool_choice_none_offers_nothing_and_history_keeps_calls_as_objects():
    assert chat({"messages": USER, "tools": TOOLS, "tool_choice": "none"}).tools is None
    use = chat({"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "time"}}})
    assert use.tools is not None and use.tools.choice == "time" and use.tools.names == NAMES
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "3C"},
    ]
    messages = chat({"messages": history, "tools": TOOLS}).messages
    assert messages[1]["tool_calls"][0]["function"] == {"name": "weather", "arguments": {"city": "Oslo"}}
    assert messages[2] == {"role": "tool", "content": "3C", "tool_call_id": "c1"}


def test_the_call_format_comes_from_the_template():
    assert template_style(template("hermes")) == HERMES
    assert template_style(template("llama3_json")) == LLAMA3
    assert template_style("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}") is None
    assert template_style("{% if tools %}{{ tools }}{% endif %}") == "unknown"
    for source in ("{{ messages }}", "{% if tools %}{{ tools }}{% endif %}"):
        use = parse_tool_use({"tools": TOOLS})
        with pytest.raises(APIError) as e:
            ChatTools.of(use, source)
        assert e.value.param == "tools" and "chat template" in e.value.message


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "weather"}}])
def test_a_forced_call_needs_no_template_support(choice):
    """The tools go into the prompt as text when the template cannot render them; the call is a bare JSON one."""
    use = parse_tool_use({"tools": TOOLS, "tool_choice": choice})
    plain = ChatTools.of(use, "{{ messages }}")
    assert plain is not None and plain.style == LLAMA3 and plain.offered() is None
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
    history = [{"role": "user", "content": "Oslo?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    system, user, assistant = plain.messages(history)
    assert (
        system["role"] == "system" and '"name": "weather"' in system["content"] and "Weather now" in system["content"]
    )
    assert user == history[0] and json.loads(assistant["content"]) == {
        "name": "weather",
        "parameters": {"city": "Oslo"},
    }
    own = plain.messages([{"role": "system", "content": "Be brief."}, *history[:1]])
    assert len(own) == 2 and own[0]["content"].startswith("Be brief.\n\n")
    rendering = ChatTools.of(use, "{% if tools %}{{ tools }}{% endif %}")  # renders tools, in a format unknown here
    assert rendering is not None and rendering.style == LLAMA3 and rendering.offered() == use.template_tools()
    assert json.loads(plain.grammar(None) or "")["begin"] == ""


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
def test_templates_render_tools_and_a_tool_turn(name):
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo", "unit": "c"}}}
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "3 degrees", "tool_call_id": "c1"},
    ]
    text = _compile(template(name)).render(messages=messages, tools=TOOLS, add_generation_prompt=True, bos_token="")
    assert "Weather now" in text and '"weather"' in text and "3 degrees" in text and '"Oslo"' in text


CALL = '{"name": "weather", "arguments": {"city": "Oslo", "unit": "c"}}'


@pytest.mark.parametrize(
    "style, text, content, calls",
    [
        (HERMES, f"<tool_call>\n{CALL}\n</tool_call>", None, [("weather", {"city": "Oslo", "unit": "c"})]),
        (
            HERMES,
            f"Let me look.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n"
            '{"name": "time", "arguments": {}}\n</tool_call>',
            "Let me look.",
            [("weather", {"city": "Oslo", "unit": "c"}), ("time", {})],
        ),
        (HERMES, f"<tool_call>\n{CALL}", None, [("weather", {"city": "Oslo", "unit": "c"})]),  # unclosed, at the end
        (HERMES, '<tool_call>\n{"name": "weather", "arguments": {\n</tool_call>', "<tool_call>", []),
        (HERMES, '<tool_call>\n{"name": "rain", "arguments": {}}\n</tool_call>', "<tool_call>", []),
        (HERMES, f"<tool_call>\n{CALL}\n</tool_call> and more text", "<tool_call>", []),
        (HERMES, "Just text.", "Just text.", []),
        (LLAMA3, '{"name": "time", "parameters": {}}', None, [("time", {})]),
        (
            LLAMA3,
            '<|python_tag|>{"name": "time", "parameters": {}}; {"name": "weather", "parameters": {"city": "A"}}',
            None,
            [("time", {}), ("weather", {"city": "A"})],
        ),
        (LLAMA3, 'It is {"name": "time"}', "It is", []),
        (LLAMA3, '{"name": "time", "parameters": ', "{", []),
    ],
)
def test_calls_are_parsed_and_anything_malformed_stays_text(style, text, content, calls):
    got_content, got = parse_calls(text, style, NAMES)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    if calls:
        assert got_content == content
        assert all(c["type"] == "function" and c["id"].startswith("call_") and len(c["id"]) == 29 for c in got)
        assert len({c["id"] for c in got}) == len(got)
    else:
        assert got_content == text and got_content.startswith(content)


ARGS = st.dictionaries(st.text("abcxyz", min_size=1, max_size=5), st.integers() | st.text(max_size=8), max_size=3)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(sorted(NAMES)), ARGS), min_size=1, max_size=3),
    st.sampled_from([HERMES, LLAMA3]),
    st.lists(st.integers(1, 7), max_size=6),
)
def test_rendered_calls_parse_back_whole_or_streamed_in_any_pieces(calls, style, cuts):
    key = "arguments" if style == HERMES else "parameters"
    objs = [json.dumps({"name": n, key: a}) for n, a in calls]
    text = "".join(f"<tool_call>\n{o}\n</tool_call>\n" for o in objs) if style == HERMES else "; ".join(objs)
    _, got = parse_calls(text, style, NAMES)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    stream, sent, pos = ToolStream(style, NAMES), "", 0
    for cut in cuts:
        sent += stream.push(text[pos : pos + cut])
        pos += cut
    sent += stream.push(text[pos:]) + stream.finish()
    assert sent == "" and [c["function"]["name"] for c in stream.found] == [n for n, _ in calls]


def test_streamed_text_without_a_call_goes_out_whole_and_text_before_a_call_goes_out_early():
    stream = ToolStream(HERMES, NAMES)
    assert stream.push("Hello <tool") == "Hello"  # held: it may open a call (and blanks before a call)
    assert stream.push("box> world") == " <toolbox> world"
    assert stream.finish() == "" and stream.found == []
    stream = ToolStream(LLAMA3, NAMES)
    assert stream.push(" <|py") == "" and stream.push("thon tag?") == " <|python tag?"


@pytest.fixture(scope="module")
def llama(tiny_dirs):
    path = tiny_dirs["llama"]
    tok = Tokenizer.from_path(path)
    return tok, Grammars(str(path), tok.vocab_size, tok.eos_token_ids)


@pytest.mark.parametrize("style", [HERMES, LLAMA3])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "weather"}}])
def test_a_forced_call_is_a_valid_call_of_a_listed_tool_whatever_the_logits(llama, style, choice):
    tok, grammars = llama
    source = template("hermes" if style == HERMES else "llama3_json")
    tools = ChatTools.of(parse_tool_use({"tools": TOOLS, "tool_choice": choice}), source)
    assert tools is not None
    grammar = tools.grammar(None)
    states = constrained(grammars, grammar, range(6))
    run(Sampler(tok.vocab_size), states, tok.vocab_size, tok.eos_token_ids, steps=150)
    for s in states:
        assert s.output_ids[-1] in tok.eos_token_ids
        text = tok.decode(s.output_ids[:-1])
        _, calls = parse_calls(text, style, NAMES)
        assert len(calls) == 1, text
        name, args = calls[0]["function"]["name"], json.loads(calls[0]["function"]["arguments"])
        assert name == "weather" or (choice == "required" and name == "time"), text
        if name == "weather":
            assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f"), args
            jsonschema.validate({"city": "x", "unit": args["unit"]}, WEATHER)


def test_parallel_tool_calls_false_keeps_the_first_call():
    two = f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n" + '{"name": "time", "arguments": {}}\n</tool_call>'
    choice = {"index": 0, "message": {"role": "assistant", "content": two}, "finish_reason": "stop"}
    for parallel, want in ((True, ["weather", "time"]), (False, ["weather"])):
        tools = ChatTools.of(parse_tool_use({"tools": TOOLS, "parallel_tool_calls": parallel}), template("hermes"))
        assert tools is not None
        answer = tools.answer(choice)
        assert [c["function"]["name"] for c in answer["message"]["tool_calls"]] == want
        assert answer["finish_reason"] == "tool_calls" and answer["message"]["content"] is None
        stream = tools.stream()
        assert stream.push(two) == "" and stream.finish() == ""
        assert [c["function"]["name"] for c in stream.found] == want


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["", "Sure.", "\nLet me check", "  a <b> c"]),
    st.sampled_from(["", "\n", "\n\n", " \n "]),
    st.lists(st.integers(1, 5), max_size=8),
)
def test_streamed_content_before_a_call_equals_the_whole_answers(words, blanks, cuts):
    text = f"{words}{blanks}<tool_call>\n{CALL}\n</tool_call>"
    content, calls = parse_calls(text, HERMES, NAMES)
    assert len(calls) == 1
    stream, sent, pos = ToolStream(HERMES, NAMES), "", 0
    for cut in cuts:
        sent += stream.push(text[pos : pos + cut])
        pos += cut
    sent += stream.push(text[pos:]) + stream.finish("stop")
    assert sent == (content or "") and len(stream.found) == 1


def test_an_answer_cut_by_max_tokens_stays_text_even_if_a_call_parses():
    text = f"<tool_call>\n{CALL}\n</tool_call>"
    tools = ChatTools.of(parse_tool_use({"tools": TOOLS}), template("hermes"))
    assert tools is not None
    cut = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
    assert tools.answer(cut) == cut
    stream = tools.stream()
    assert stream.push(text) + stream.finish("length") == text and stream.found == []
