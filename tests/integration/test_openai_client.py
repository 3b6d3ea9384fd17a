"""The OpenAI API as its official Python client uses it, against the monolithic server and the P/D
stack's router: completions (one prompt or a batch) and chat, streamed and not, stream_options, n, seeds,
logprobs, echo, stop, structured outputs and errors, each as the client hands them to a user."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import requests

from tests.integration.procs import PDStack, idle_and_flushed, scaled, serve

pytestmark = pytest.mark.integration
# Every process serves the model under the name the stack's router serves it under.
FLAGS = ("--page-size", "4", "--chunk-size", "32", "--max-total-tokens", "8192", "--served-model-name", "tiny")
USER = [{"role": "user", "content": "Tell me a story about the sea."}]


@pytest.fixture(scope="module")
def stack(tiny_model):
    s = PDStack(tiny_model, *FLAGS).wait_healthy()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def mono(tiny_model):
    p = serve(tiny_model, *FLAGS).wait_healthy()
    yield p
    p.stop()


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=scaled(60))


@pytest.fixture(scope="module")
def both(mono, stack) -> dict[str, openai.OpenAI]:
    return {"mono": client(mono.url), "pd": client(stack.router.url)}


@pytest.fixture(scope="module")
def model(both) -> str:
    names = {name: [m.id for m in c.models.list().data] for name, c in both.items()}
    assert names["mono"] == names["pd"] and len(names["mono"]) == 1, names
    return names["mono"][0]


def chat(c: openai.OpenAI, model: str, **kw):
    return c.chat.completions.create(model=model, messages=kw.pop("messages", USER), **kw)


def complete(c: openai.OpenAI, model: str, **kw):
    return c.completions.create(model=model, prompt=kw.pop("prompt", "Once upon a time"), **kw)


def streamed_text(chunks) -> tuple[dict[int, str], dict[int, str | None], list]:
    """Text and finish_reason per choice index of a stream, and its usage-only chunks."""
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    usage = []
    for ch in chunks:
        if not ch.choices:
            usage.append(ch)
        for c in ch.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return texts, finish, usage


def test_greedy_chat_and_completions_through_pd_equal_monolithic_streamed_or_not(both, model):
    got = {}
    for name, c in both.items():
        a = chat(c, model, max_tokens=12, temperature=0)
        b = complete(c, model, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        sa = streamed_text(chat(c, model, max_tokens=12, temperature=0, stream=True))
        sb = streamed_text(
            complete(c, model, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True})
        )
        assert sa[0] == {0: a.choices[0].message.content} and sa[1] == {0: a.choices[0].finish_reason}
        assert sb[0] == {0: b.choices[0].text} and sb[1] == {0: "length"} == {0: b.choices[0].finish_reason}
        assert a.choices[0].message.role == "assistant" and a.object == "chat.completion"
        assert b.usage.completion_tokens == 12 and b.usage.total_tokens == b.usage.prompt_tokens + 12
        got[name] = (a.choices[0].message.content, a.usage, b.choices[0].text, b.usage)
    assert got["pd"] == got["mono"]
    assert got["mono"][0] and got["mono"][2]


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_stream_options_include_usage_ends_with_the_usage(both, model, api):
    """The last chunk carries the usage and no choice; earlier ones carry none (through the router too)."""
    call = chat if api == "chat" else complete
    for c in both.values():
        whole = call(c, model, max_tokens=10, temperature=0)
        chunks = list(call(c, model, max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert all(ch.usage is None for ch in chunks[:-1])
        assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_seeded_n3_through_pd_equals_monolithic_and_repeats(both, model, api):
    call = chat if api == "chat" else complete

    def texts(c, seed: int, stream: bool = False) -> list[str]:
        kw = {"max_tokens": 24, "temperature": 1, "n": 3, "seed": seed}
        if stream:
            by_index, finish, _ = streamed_text(call(c, model, stream=True, **kw))
            assert sorted(finish) == [0, 1, 2]
            return [by_index[i] for i in range(3)]
        r = call(c, model, **kw)
        assert [ch.index for ch in r.choices] == [0, 1, 2]
        return [ch.message.content if api == "chat" else ch.text for ch in r.choices]

    mono = texts(both["mono"], 7)
    assert texts(both["pd"], 7) == mono
    assert texts(both["pd"], 7, stream=True) == mono
    assert texts(both["mono"], 7) == mono  # reproducible
    assert len(set(mono)) == 3, mono  # one seed, three different samples (choice i draws with seed + i)
    assert texts(both["mono"], 8) != mono


def test_logprobs_chat_and_completions_pd_equals_monolithic(both, model):
    out = {}
    for name, c in both.items():
        a = chat(c, model, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
        content = a.choices[0].logprobs.content
        assert len(content) == a.usage.completion_tokens
        assert "".join(t.token for t in content) == a.choices[0].message.content
        for t in content:
            assert t.logprob <= 0 and len(t.top_logprobs) == 3
            assert t.top_logprobs[0].logprob >= t.logprob - 1e-6  # greedy: the chosen one is the best
        b = complete(c, model, max_tokens=8, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
        lp = b.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
        assert all(len(top) == 2 for top in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)
        tops = [[x.token for x in t.top_logprobs] for t in content]
        # Logprobs without alternatives next (decode reuses the aux slot just freed): none, not the last request's.
        bare = chat(c, model, max_tokens=4, temperature=0, logprobs=True).choices[0].logprobs.content
        assert bare and [t.top_logprobs for t in bare] == [[]] * len(bare), name
        out[name] = ([t.logprob for t in content], lp.token_logprobs, [t.token for t in content], lp.tokens, tops)
    assert out["pd"][2:] == out["mono"][2:]
    for got, want in zip(out["pd"][:2], out["mono"][:2], strict=True):
        assert got == pytest.approx(want, abs=1e-4)


def test_stop_cuts_before_the_stop_string_streamed_or_not(both, model):
    free = complete(both["mono"], model, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    text = free.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop.strip()) >= 2, text  # a stop string the greedy answer does contain
    for c in both.values():
        r = complete(c, model, max_tokens=24, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "stop"
        assert r.choices[0].text == text[: text.index(stop)] and stop not in r.choices[0].text
        s, finish, _ = streamed_text(complete(c, model, max_tokens=24, temperature=0, stop=stop, stream=True))
        assert s == {0: r.choices[0].text} and finish == {0: "stop"}


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
        "weather": {"enum": ["sunny", "rain", "snow"]},
        "temperature": {"type": "integer", "minimum": -40, "maximum": 50},
        "windy": {"type": "boolean"},
        "days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]}, "maxItems": 3},
    },
    "required": ["city", "weather", "temperature", "windy", "days"],
    "additionalProperties": False,
}


def test_twenty_strict_json_schema_answers_through_pd_all_validate(both, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "strict": True, "schema": SCHEMA}}
    answers = []
    for seed in range(20):
        r = chat(both["pd"], model, max_tokens=120, temperature=1, seed=seed, response_format=fmt)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (seed, choice)
        answer = json.loads(choice.message.content)
        jsonschema.validate(answer, SCHEMA)
        answers.append(answer)
    assert len({json.dumps(a, sort_keys=True) for a in answers}) > 10  # sampled, not one fixed answer
    mono = chat(both["mono"], model, max_tokens=120, temperature=1, seed=3, response_format=fmt)
    assert json.loads(mono.choices[0].message.content) == answers[3]
    obj = chat(both["pd"], model, max_tokens=60, temperature=0, response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # the tiny model may write one endless key: a cut answer still starts as an object
        assert obj.choices[0].message.content.startswith('{"')


def test_regex_through_the_client_extra_body(both, model):
    for c in both.values():
        r = complete(c, model, max_tokens=20, temperature=1, seed=2, extra_body={"regex": "(yes|no)!"})
        assert r.choices[0].text in ("yes!", "no!") and r.choices[0].finish_reason == "stop"


BAD = [
    ({"temperature": 5}, "temperature"),
    ({"n": 0}, "n"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"extra_body": {"regex": "(open"}}, "regex"),
]


@pytest.mark.parametrize("extra, param", BAD, ids=[p for _, p in BAD])
def test_bad_requests_are_bad_request_errors_naming_the_parameter(both, model, extra, param):
    for c in both.values():
        with pytest.raises(openai.BadRequestError) as e:
            chat(c, model, **{"max_tokens": 4, **extra})
        assert e.value.status_code == 400
        assert param in e.value.message, e.value.message


def test_an_unknown_model_is_not_found(both):
    for c in both.values():
        with pytest.raises(openai.NotFoundError) as e:
            chat(c, "no-such-model", max_tokens=4)
        assert "no-such-model" in e.value.message


def tokens(tiny_model: str, *texts: str) -> list[list[int]]:
    from disagg_worker.model.tokenizer import Tokenizer

    tok = Tokenizer.from_path(tiny_model)
    return [tok.encode(t) for t in texts]


# Three prompts of mixed lengths (the longest over one 32-token chunk).
BATCH = ["Once upon a time", "The sea", "Tell me a long story about the sea, the wind and the old lighthouse. " * 3]


def as_sent(r) -> list[tuple[int, str, list[str] | None, list[float] | None, str | None]]:
    """Each choice of an answer: its index, text, tokens and token logprobs, finish_reason."""
    out = []
    for ch in r.choices:
        lp = ch.logprobs
        out.append((ch.index, ch.text, lp and lp.tokens, lp and lp.token_logprobs, ch.finish_reason))
    return out


def assert_same_choices(got: list, want: list) -> None:
    """Equal texts, tokens and finish reasons; logprobs within float noise (None where the first token has none)."""
    assert [(i, t, toks, f) for i, t, toks, _, f in got] == [(i, t, toks, f) for i, t, toks, _, f in want]
    for (_, _, _, a, _), (_, _, _, b, _) in zip(got, want, strict=True):
        if a is None or b is None:
            assert a == b
        else:
            assert [x is None for x in a] == [x is None for x in b]
            assert [x for x in a if x is not None] == pytest.approx([x for x in b if x is not None], abs=1e-4)


@pytest.mark.parametrize("form", ["token lists", "strings"])
def test_a_batch_of_prompts_answers_each_as_it_alone_monolithic_and_through_pd(both, model, tiny_model, form):
    """Prompt i's choice j is index i * n + j and equals that prompt's choice j sent alone (seeded: choice j draws
    with seed + j); the usage counts each prompt's tokens once."""
    prompts = tokens(tiny_model, *BATCH) if form == "token lists" else BATCH
    kw = {"max_tokens": 8, "temperature": 1, "seed": 11, "n": 2, "logprobs": 2, "extra_body": {"ignore_eos": True}}
    alone = [complete(both["mono"], model, prompt=p, **kw) for p in prompts]
    want = [(i * 2 + j, *c[1:]) for i, r in enumerate(alone) for j, c in enumerate(as_sent(r))]
    assert len({c[1] for c in want}) == 6, want  # six different answers: an order that is wrong shows
    for name, c in both.items():
        r = complete(c, model, prompt=prompts, **kw)
        assert [ch.index for ch in r.choices] == list(range(6)), name
        assert_same_choices(as_sent(r), want)
        assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone), name
        assert r.usage.completion_tokens == 6 * 8 and r.usage.total_tokens == r.usage.prompt_tokens + 48
        by_index, finish, usage = streamed_text(
            complete(c, model, prompt=prompts, stream=True, stream_options={"include_usage": True}, **kw)
        )
        assert by_index == {i: text for i, text, *_ in want} and finish == dict.fromkeys(range(6), "length")
        assert len(usage) == 1 and usage[0].usage.model_dump() == r.usage.model_dump(), name


def test_a_greedy_batch_through_pd_equals_monolithic_and_streams_one_done(both, model, mono, stack):
    got = {}
    for name, c in both.items():
        got[name] = as_sent(complete(c, model, prompt=BATCH, n=2, max_tokens=10, temperature=0, logprobs=1))
    assert [i for i, *_ in got["mono"]] == list(range(6))
    assert_same_choices(got["pd"], got["mono"])
    body = {"model": model, "prompt": BATCH, "n": 2, "max_tokens": 10, "temperature": 0, "stream": True}
    for url in (mono.url, stack.router.url):
        r = requests.post(f"{url}/v1/completions", json=body, timeout=scaled(60))
        events = [line for line in r.content.decode().split("\n\n") if line.strip()]
        assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1, url
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        texts = {
            i: "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"][0]["index"] == i) for i in range(6)
        }
        assert texts == {i: text for i, text, *_ in got["mono"]}, url
        assert len({ch["id"] for ch in chunks}) == 1, url  # one response


def test_echoed_batch_scores_each_prompt_as_it_alone(both, model, tiny_model):
    """lm-evaluation-harness's log-likelihood requests: token prompts, echo, logprobs and max_tokens 0."""
    prompts = tokens(tiny_model, *BATCH)
    kw = {"echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
    alone = [as_sent(complete(both["mono"], model, prompt=p, **kw))[0] for p in prompts]
    want = [(i, *c[1:]) for i, c in enumerate(alone)]
    for i, (_, text, toks, lps, finish) in enumerate(want):
        assert text and len(toks) == len(prompts[i]) and lps[0] is None and finish == "length"
    for name, c in both.items():
        r = complete(c, model, prompt=prompts, **kw)
        assert_same_choices(as_sent(r), want)
        assert r.usage.prompt_tokens == sum(map(len, prompts)) and r.usage.completion_tokens == 0, name


def test_a_batch_is_bounded_and_a_bad_prompt_of_it_is_named(both, model):
    for name, c in both.items():
        with pytest.raises(openai.BadRequestError) as e:
            complete(c, model, prompt=["x"] * 5, n=16, max_tokens=2)
        assert e.value.body["param"] == "prompt" and "80 choices" in e.value.message, name
        with pytest.raises(openai.BadRequestError) as e:
            complete(c, model, prompt=["x", ""], max_tokens=2)
        assert e.value.body["param"] == "prompt[1]", (name, e.value.body)


def test_echo_with_logprobs_is_bounded_at_the_edge_and_a_small_one_is_served(both, model):
    """prompt tokens x (logprobs + 1) x n over the bound (tuning.py: 2^18) is a 400 naming the fields, from the
    router before any worker reads it and from a monolithic server; a small echo still scores the prompt."""
    long_ids = [7] * 3000  # 3000 x 6 x 16 = 288000 entries; fits the context (4096) and the KV (8192)
    for name, c in both.items():
        with pytest.raises(openai.BadRequestError) as e:
            complete(c, model, prompt=long_ids, echo=True, logprobs=5, n=16, max_tokens=1)
        assert e.value.body["param"] == "echo, logprobs, n", (name, e.value.body)
        assert "3000 prompt tokens x (logprobs 5 + 1) x n 16" in e.value.message, name
        small = complete(c, model, prompt="Once upon a time", echo=True, logprobs=5, n=2, max_tokens=2, temperature=0)
        for choice in small.choices:
            lps = choice.logprobs
            assert choice.text.startswith("Once upon a time"), name
            assert lps.token_logprobs[0] is None and all(v is not None for v in lps.token_logprobs[1:]), name
            assert all(len(top) >= 1 for top in lps.top_logprobs[1:]), name
    # A text prompt through a router without --tokenizer counts as its UTF-8 bytes (no more tokens than that).
    with pytest.raises(openai.BadRequestError) as e:
        complete(both["pd"], model, prompt="ab" * 1500, echo=True, logprobs=5, n=16, max_tokens=1)
    assert e.value.body["param"] == "echo, logprobs, n" and "UTF-8 bytes" in e.value.message


def test_an_api_key_is_checked_as_the_client_sends_it(tiny_model, both, model, mono, stack):
    keyed = serve(tiny_model, *FLAGS, "--api-key", "sk-right").wait_healthy()
    try:
        with pytest.raises(openai.AuthenticationError):
            chat(client(keyed.url, "sk-wrong"), model, max_tokens=4)
        r = chat(client(keyed.url, "sk-right"), model, max_tokens=4, temperature=0)
        assert (
            r.choices[0].message.content
            == chat(both["mono"], model, max_tokens=4, temperature=0).choices[0].message.content
        )
    finally:
        keyed.stop()
    for url in (mono.url, stack.prefill.url, stack.decode.url):  # nothing the suite sent is left behind
        st = idle_and_flushed(url)
        assert st["pages_used"] == 0 and not any(st["queues"].values()), (url, st)
