"""Request parsing: what a client gets back for the bodies it sends."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disagg_worker.engine.sampling import SamplingParams
from disagg_worker.request.errors import APIError
from disagg_worker.request.limits import RequestLimits
from disagg_worker.server.protocol import (
    ChatRequest,
    CompletionRequest,
    parse_chat,
    parse_completions,
    parse_generate,
    parse_json,
)

MODEL, CTX, VOCAB = "tiny-llama", 2048, 32000


def completions(body, vocab=None, ctx=CTX):
    return parse_completions(body, MODEL, RequestLimits(ctx, vocab))


def completion(body, vocab=None):
    """A body with one prompt: its one request."""
    [req] = completions(body, vocab)
    return req


def chat(body):
    return parse_chat(body, MODEL, RequestLimits(CTX))


def generate(body):
    return parse_generate(body, RequestLimits(CTX, VOCAB))


def fit_to_context(sampling, prompt_len, max_context, explicit):
    return RequestLimits(max_context).fit(sampling, prompt_len, explicit)


def error(fn, body) -> APIError:
    with pytest.raises(APIError) as e:
        fn(body)
    return e.value


USER = [{"role": "user", "content": "hi"}]


def test_completion_maps_openai_fields():
    req = completion(
        {
            "model": MODEL,
            "prompt": "Once upon",
            "max_tokens": 32,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "seed": 42,
            "frequency_penalty": 0.5,
            "presence_penalty": -0.5,
            "repetition_penalty": 1.1,
            "stop": "\n",
            "stop_token_ids": [2],
            "ignore_eos": True,
            "min_tokens": 4,
            "logprobs": 3,
            "skip_special_tokens": False,
            "stream": True,
            "stream_options": {"include_usage": True},
            "n": 2,
            "user": "u1",
            "some_unknown_field": {"x": [1]},
        }
    )
    assert isinstance(req, CompletionRequest)
    assert req.prompt == "Once upon" and req.stream and req.stream_options_include_usage
    assert (req.n, req.user, req.max_tokens_set) == (2, "u1", True)
    assert req.sampling == SamplingParams(
        max_new_tokens=32,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=42,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        repetition_penalty=1.1,
        stop=("\n",),
        stop_token_ids=(2,),
        ignore_eos=True,
        min_new_tokens=4,
        logprobs=3,
        skip_special_tokens=False,
    )


def test_completion_defaults_and_missing_model():
    req = completion({"prompt": "x"})
    assert req.model == MODEL and req.sampling.max_new_tokens == 16 and not req.max_tokens_set
    assert req.sampling.logprobs is None and req.n == 1 and not req.stream


@pytest.mark.parametrize("prompt, expected", [([5, 6], [5, 6]), (["one"], "one"), ([[7, 8]], [7, 8])])
def test_completion_accepts_single_prompt_shapes(prompt, expected):
    assert completion({"prompt": prompt}).prompt == expected


def test_token_prompt_shrinks_default_and_rejects_explicit_overflow():
    req = completion({"prompt": [1] * 2040})
    assert req.sampling.max_new_tokens == 8
    e = error(completion, {"prompt": [1] * 2040, "max_tokens": 9})
    assert (e.status, e.param) == (400, "max_tokens") and "2048" in e.message
    e = error(completion, {"prompt": [1] * 2048})
    assert (e.status, e.param) == (400, "prompt")


def test_fit_to_context_after_tokenisation():
    chat_req = chat({"messages": USER})
    assert chat_req.sampling.max_new_tokens == 1024 and not chat_req.max_tokens_set
    fitted = fit_to_context(chat_req.sampling, 2000, CTX, chat_req.max_tokens_set)
    assert fitted.max_new_tokens == 48
    explicit = chat({"messages": USER, "max_tokens": 100})
    e = error(lambda s: fit_to_context(s, 2000, CTX, True), explicit.sampling)
    assert e.status == 400 and "2048" in e.message


def test_chat_maps_fields_and_normalises_messages():
    req = chat(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None},
                {"role": "tool", "content": "42", "name": "calc"},
            ],
            "max_tokens": 10,
            "max_completion_tokens": 20,
            "logprobs": True,
            "top_logprobs": 4,
            "add_generation_prompt": False,
        }
    )
    assert isinstance(req, ChatRequest)
    assert req.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42", "name": "calc"},
    ]
    assert req.sampling.max_new_tokens == 20 and req.sampling.logprobs == 4
    assert not req.add_generation_prompt
    assert chat({"messages": USER, "logprobs": True}).sampling.logprobs == 0
    assert chat({"messages": USER}).sampling.logprobs is None


def test_generate_native_body():
    req = generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 5, "temperature": 0}, "stream": True})
    assert req.input_ids == [1, 2] and req.text is None and req.stream
    assert req.sampling.max_new_tokens == 5 and req.sampling.is_greedy
    assert generate({"text": "hello"}).text == "hello"


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"[1, 2]",
        b'"text"',
        b"null",
        b'{"a": NaN}',
        b'{"a": Infinity}',
        b"\xff\xfe\x00",
        b"[" * 100000,
        b'{"n": ' + b"9" * 5000 + b"}",
    ],
)
def test_malformed_json_is_400(raw):
    e = error(parse_json, raw)
    assert (e.status, e.type) == (400, "invalid_request_error")


def test_parse_json_returns_object():
    assert parse_json(b'{"prompt": "x", "n": 1}') == {"prompt": "x", "n": 1}


def test_unknown_model_is_404_in_openai_shape():
    e = error(completion, {"model": "gpt-9", "prompt": "x"})
    assert e.status == 404
    assert e.body() == {
        "error": {
            "message": "The model `gpt-9` does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


BAD_COMPLETIONS = [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -5}, "max_tokens"),
    ({"prompt": "x", "max_tokens": CTX + 1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**30}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -(10**5000)}, "max_tokens"),
    ({"prompt": "x", "n": 10**5000}, "n"),
    ({"prompt": "x", "seed": 10**5000}, "seed"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 16.0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "16"}, "max_tokens"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt[1]"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": {"text": "x"}}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "x", "model": 3}, "model"),
    ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "temperature": float("nan")}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -3}, "top_k"),
    ({"prompt": "x", "min_p": 2}, "min_p"),
    ({"prompt": "x", "seed": 1.5}, "seed"),
    ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "x", "presence_penalty": 10**400}, "presence_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "stop": ""}, "stop"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "stop": ["s"] * 17}, "stop"),
    ({"prompt": "x", "stop": ["ok", "s" * 1025]}, "stop"),
    ({"prompt": "x", "stop_token_ids": [True]}, "stop_token_ids"),
    ({"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
    ({"prompt": "x", "min_tokens": 17}, "min_tokens"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 17}, "n"),
    ({"prompt": "x", "echo": 1}, "echo"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"prompt": "x\ud800"}, "prompt"),
]


@pytest.mark.parametrize("body, param", BAD_COMPLETIONS)
def test_bad_completion_fields_name_the_param(body, param):
    e = error(completion, body)
    assert (e.status, e.type, e.param) == (400, "invalid_request_error", param)
    assert param.split(".")[-1] in e.message


def test_stop_strings_up_to_the_length_cap_are_taken():
    assert completion({"prompt": "x", "stop": ["s" * 1024]}).sampling.stop == ("s" * 1024,)
    assert "at most 1024 characters" in error(completion, {"prompt": "x", "stop": "s" * 1025}).message


def test_stop_token_ids_checked_against_vocab():
    assert error(lambda b: completion(b, vocab=100), {"prompt": "x", "stop_token_ids": [100]}).param == "stop_token_ids"
    assert completion({"prompt": "x", "stop_token_ids": [99]}, vocab=100).sampling.stop_token_ids == (99,)


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content"),
    ({"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": USER, "max_tokens": CTX + 1}, "max_tokens"),
    ({"messages": USER, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 25}, "top_logprobs"),
    ({"messages": USER, "logprobs": 2}, "logprobs"),
    ({"messages": USER, "add_generation_prompt": "no"}, "add_generation_prompt"),
]


@pytest.mark.parametrize("body, param", BAD_CHATS)
def test_bad_chat_fields_name_the_param(body, param):
    e = error(chat, body)
    assert (e.status, e.param) == (400, param)


TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
UNSUPPORTED_CHATS = [
    ({"messages": USER, "functions": [TOOL["function"]]}, "functions", "legacy function-calling fields"),
    ({"messages": USER, "tool_choice": "required"}, "tool_choice", '"required" needs tools'),
    ({"messages": USER, "tool_choice": {"type": "function"}}, "tool_choice", 'must be "none", "auto"'),
    ({"messages": USER, "response_format": {"type": "yaml"}}, "response_format", 'type "yaml" is not supported'),
    ({"messages": USER, "response_format": "json"}, "response_format", "not supported"),
    (
        {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
        "must be a JSON schema",
    ),
]


@pytest.mark.parametrize("body, param, says", UNSUPPORTED_CHATS)
def test_tools_and_unknown_response_formats_are_refused_not_ignored(body, param, says):
    e = error(chat, body)
    assert (e.status, e.param) == (400, param)
    assert says in e.message


def test_chat_without_tools_or_with_text_format_is_accepted():
    for extra in ({"tools": []}, {"tools": None, "tool_choice": "none"}, {"tool_choice": "auto"}):
        assert chat({"messages": USER, **extra}).messages == USER
        assert chat({"messages": USER, **extra}).tools is None
    # Tools and calls in the history are parsed here; whether the model's template can offer them is the API's
    # to say (a 400 naming tools for a template without them: test_tool_calls.py, tests/integration/test_tools.py).
    offered = chat({"messages": USER, "tools": [TOOL]}).tools
    assert offered is not None and offered.names == {"weather"} and offered.choice == "auto"
    history = chat({"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}]}).messages
    assert history[1]["tool_calls"][0]["function"] == {"name": "weather", "arguments": {}}
    assert chat({"messages": USER, "response_format": {"type": "text"}}).sampling.grammar is None


def test_response_format_becomes_a_canonical_sampling_param():
    schema = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    got = chat({"messages": USER, "response_format": fmt}).sampling.grammar
    assert json.loads(got) == {"type": "json_schema", "schema": schema}
    got = chat({"messages": USER, "response_format": {"type": "json_object"}}).sampling.grammar
    assert json.loads(got) == {"type": "json_object"}


BAD_GENERATES = [
    ({}, "input_ids"),
    ({"input_ids": [1], "text": "x"}, "input_ids"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [VOCAB]}, "input_ids"),
    ({"text": ""}, "text"),
    ({"text": 5}, "text"),
    ({"text": "x", "sampling_params": []}, "sampling_params"),
    ({"text": "x", "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
    ({"text": "x", "sampling_params": {"top_k": 1.0}}, "sampling_params.top_k"),
    ({"text": "x", "sampling_params": {"min_new_tokens": 99}}, "sampling_params.min_new_tokens"),
    ({"input_ids": [1] * 2000, "sampling_params": {"max_new_tokens": 100}}, "sampling_params.max_new_tokens"),
    ({"text": "x", "stream": None, "sampling_params": {"stop_token_ids": [VOCAB]}}, "sampling_params.stop_token_ids"),
]


@pytest.mark.parametrize("body, param", BAD_GENERATES)
def test_bad_generate_fields_name_the_param(body, param):
    e = error(generate, body)
    assert (e.status, e.param) == (400, param)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.sampled_from([10**400, -(10**400), float("nan"), "\ud800", "", 0, -1, True]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=12,
)

VALID = {
    "completion": {"model": MODEL, "prompt": "hi", "max_tokens": 8, "temperature": 0.5, "stop": ["x"], "n": 1},
    "chat": {"model": MODEL, "messages": USER, "max_completion_tokens": 8, "logprobs": True, "top_logprobs": 2},
    "generate": {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 8, "top_k": 5}, "stream": False},
}
FIELDS = sorted(
    {
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "min_tokens",
        "logprobs",
        "top_logprobs",
        "n",
        "echo",
        "stream",
        "stream_options",
        "user",
        "input_ids",
        "text",
        "sampling_params",
        "max_new_tokens",
        "add_generation_prompt",
        "skip_special_tokens",
    }
)


@st.composite
def mutated_bodies(draw):
    kind = draw(st.sampled_from(sorted(VALID)))
    body = json.loads(json.dumps(VALID[kind]))
    for _ in range(draw(st.integers(1, 4))):
        nested = body.get("sampling_params")
        target = nested if isinstance(nested, dict) and draw(st.booleans()) else body
        key = draw(st.sampled_from(FIELDS))
        if draw(st.integers(0, 5)) == 0:
            target.pop(key, None)
        else:
            target[key] = draw(json_values)
    return kind, body


PARSERS = {"completion": completions, "chat": chat, "generate": generate}


def assert_request_or_4xx(fn, body):
    try:
        req = fn(body)
    except APIError as e:
        assert 400 <= e.status < 500 and e.type == "invalid_request_error"
        assert json.loads(json.dumps(e.body()))["error"]["message"]
        return
    for r in req if isinstance(req, list) else [req]:  # completions: one request per prompt
        assert r.sampling.validate() is None


@settings(max_examples=1200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=mutated_bodies())
def test_mutated_valid_bodies_parse_or_give_4xx(case):
    kind, body = case
    assert_request_or_4xx(PARSERS[kind], body)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=json_values, kind=st.sampled_from(sorted(PARSERS)))
def test_arbitrary_json_values_parse_or_give_4xx(body, kind):
    assert_request_or_4xx(PARSERS[kind], body)


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=64) | json_values.map(lambda v: json.dumps(v).encode()))
def test_parse_json_only_raises_api_errors(raw):
    try:
        body = parse_json(raw)
    except APIError as e:
        assert e.status == 400
        return
    assert isinstance(body, dict)
