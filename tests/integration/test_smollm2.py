"""SmolLM2-135M-Instruct, the demo model: the tokenizer and the greedy answers to eight chat prompts
equal transformers' (its own GGUF loader, dequantised to float32), monolithic (served from the GGUF file)
and through router + prefill + decode over Mooncake TCP (what `make serve` runs: the GGUF converted
once, `disagg serve --local` on the directory); the README's first example answers as shown, and every example
request of the README and of docs/ works on what `make serve` starts; and today's clients get what a user
expects: the official client's Responses API (an answer, a follow-up by `previous_response_id`, a forced
function call), instructor's default tools mode and the OpenAI Agents SDK.

Real weights on a CPU: marked `real_model`. The servers start before transformers loads its copy, so
the loads overlap, and each server gets the eight prompts at once; about a minute on 2 cores.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import re
import subprocess
from pathlib import Path

import openai
import pydantic
import pytest
import requests
import torch
import transformers

from disagg_worker.model.demo import SERVED_NAME, demo_gguf
from disagg_worker.model.tokenizer import Tokenizer
from tests.integration.procs import DISAGG, Proc, free_port, scaled, serve

pytestmark = [pytest.mark.integration, pytest.mark.real_model]
ROOT = Path(__file__).resolve().parents[2]
MAX_NEW = 24
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "What is 12 times 12?"}],
    [{"role": "user", "content": "Explain photosynthesis in one sentence."}],
    [{"role": "user", "content": "Who wrote Romeo and Juliet?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Say hello to my friend."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
]
TEXTS = [
    "Hello 2024 world, x\u00b2 + 10\u00b3",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u2014 \u201cquoted\u201d \u6771\u4eac and \U0001f680 rockets",
    "  leading spaces, tabs\tand\nnewlines  ",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "def f(x):\n    return x**2  # I'm you're THEY'LL\n\n",
    "\U0001f600\U0001f44d\U0001f3fd \u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac "
    "\u0440\u0443\u0441\u0441\u043a\u0438\u0439 <repo_name>x<file_sep>",
]


@pytest.fixture(scope="module")
def gguf() -> Path:
    return demo_gguf()


@pytest.fixture(scope="module")
def started(gguf, tmp_path_factory):
    """(monolithic on the GGUF file, `make serve`'s P/D stack), started but not yet waited for."""
    mono = serve(str(gguf), "--max-total-tokens", "4096")
    model_dir = tmp_path_factory.mktemp("models") / SERVED_NAME
    procs = [mono]
    try:
        subprocess.run([DISAGG, "model", "convert-gguf", "--out", str(model_dir)], check=True, timeout=scaled(300))
        port = free_port()
        procs.append(Proc(["serve", "--local", "--model", str(model_dir), "--port", str(port)], port))
        yield mono, procs[1]
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def reference(gguf, started):
    """transformers' tokenizer and model; `started` first, so the servers load meanwhile."""
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return tok, model.eval()


@pytest.fixture(scope="module")
def mono(started) -> Proc:
    return started[0].wait_healthy(timeout=300)


@pytest.fixture(scope="module")
def make_serve(started) -> Proc:
    return started[1].wait_healthy(timeout=300)


@pytest.fixture(scope="module")
def ours(gguf) -> Tokenizer:
    return Tokenizer.from_path(gguf)


def prompt_ids(tok: Tokenizer, messages: list[dict]) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)


def reference_greedy(model, ids: list[int], eos: tuple[int, ...]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=list(eos),
            pad_token_id=eos[0],
        )
    return out[0, len(ids) :].tolist()


def greedy(url: str, ids: list[int]) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}
    r = requests.post(f"{url}/generate", json=body, timeout=scaled(300))
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def greedy_all(url: str, prompts: list[list[int]]) -> list[list[int]]:
    """All prompts at once, so the server batches them."""
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda ids: greedy(url, ids), prompts))


def without_eos(ids: list[int], eos: tuple[int, ...]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in eos else ids


def test_tokenizer_matches_transformers(ours, reference):
    hf_tok, _ = reference
    for text in TEXTS:
        assert ours.encode(text) == hf_tok(text).input_ids, text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    for chat in CHATS:
        expected = hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        assert ours.apply_chat_template(chat) == expected
        assert prompt_ids(ours, chat) == hf_tok(expected, add_special_tokens=False).input_ids
    assert ours.eos_token_ids == (2, 0)  # <|im_end|> (the file's eos) and <|endoftext|>
    # Where the two differ: transformers' GGUF conversion ignores the file's pre-tokenizer name
    # (`smollm`) and keeps a space with the numerals after it; llama.cpp's `smollm` split (as the
    # StarCoder-style tokenizer it names) cuts every numeral off first. We follow llama.cpp.
    pieces = [piece for piece, _ in ours.tok.pre_tokenizer.pre_tokenize_str(" \u0661\u0662")]
    assert pieces == ["\u0120", "\u00d9\u00a1", "\u00d9\u00a2"]  # the space, then each digit's bytes


@pytest.fixture(scope="module")
def expected(ours, reference) -> list[list[int]]:
    """transformers' greedy answer to each chat prompt, one prompt at a time, without the final EOS."""
    eos = ours.eos_token_ids
    return [without_eos(reference_greedy(reference[1], prompt_ids(ours, chat), eos), eos) for chat in CHATS]


def test_greedy_answers_equal_transformers_monolithic_and_pd(ours, reference, expected, mono, make_serve):
    eos = ours.eos_token_ids
    prompts = [prompt_ids(ours, chat) for chat in CHATS]
    for name, url in (("monolithic", mono.url), ("P/D", make_serve.url)):
        assert [without_eos(ids, eos) for ids in greedy_all(url, prompts)] == expected, name
    first = reference[0].decode(expected[0], skip_special_tokens=True)
    assert "Paris" in first, first


def chat_text(url: str, chat: list[dict]) -> str:
    body = {"messages": chat, "max_tokens": MAX_NEW, "temperature": 0}
    r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=scaled(300))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_chat_text_through_the_router_equals_transformers(reference, expected, make_serve):
    with cf.ThreadPoolExecutor(len(CHATS)) as pool:
        texts = list(pool.map(lambda chat: chat_text(make_serve.url, chat), CHATS))
    assert texts == [reference[0].decode(ids, skip_special_tokens=True) for ids in expected]


def test_a_json_schema_answer_through_the_router(make_serve):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    body = {
        "messages": [{"role": "user", "content": "What is the capital of France? Answer in JSON with a key city."}],
        "max_tokens": MAX_NEW,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    }
    r = requests.post(f"{make_serve.url}/v1/chat/completions", json=body, timeout=scaled(300))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert json.loads(choice["message"]["content"]) == {"city": "Paris"}


def readme_first_example() -> tuple[str, dict]:
    """The README's first curl command and the response it shows (the JSON block right after it)."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"```bash\n(curl .*?)```.*?```json\n(.*?)```", text, re.S)
    assert match, "the README shows no curl example followed by its response"
    return match.group(1), json.loads(match.group(2))


def test_readme_first_example_answers_as_shown(make_serve):
    command, shown = readme_first_example()
    assert "/v1/chat/completions" in command and "capital of France" in command
    cmd = command.replace("localhost:8000", f"127.0.0.1:{make_serve.port}").replace("curl ", "curl -sf ", 1)
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=scaled(300))
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    content = answer["choices"][0]["message"]["content"]
    assert "Paris" in content
    assert content == shown["choices"][0]["message"]["content"]
    assert answer["model"] == shown["model"] == SERVED_NAME


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def documented_requests() -> list[str]:
    """The example requests of the README and of the pages of docs/: every `bash` or `sh` block that is a curl."""
    blocks = [b for page in DOCS for b in re.findall(r"```(?:bash|sh)\n(.*?)```", page.read_text(), re.S)]
    return [b for b in blocks if b.lstrip().startswith("curl")]


def test_every_documented_example_works_on_make_serve(make_serve):
    """Every curl example of the README and docs/ against what `make serve` starts, the model the README names
    (the /generate example of docs/api.md is in SmolLM2's token ids)."""
    examples = documented_requests()
    assert len(examples) >= 5, "the README and docs/ show fewer example requests than they did"
    for ex in examples:
        cmd = ex.replace("localhost:8000", f"127.0.0.1:{make_serve.port}")
        out = subprocess.run(
            ["bash", "-c", "set -o pipefail; " + cmd.replace("curl ", "curl -sf ", 1)],
            capture_output=True,
            text=True,
            timeout=scaled(120),
        )
        assert out.returncode == 0, f"{ex}\n{out.stderr}"
        assert out.stdout.strip(), ex


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=scaled(300))


def test_the_responses_api_answers_and_continues_a_conversation_monolithic_and_pd(mono, make_serve):
    for url in (mono.url, make_serve.url):
        c = client(url)
        first = c.responses.create(model=SERVED_NAME, input="What is the capital of France?", temperature=0)
        assert first.status == "completed" and "Paris" in first.output_text
        second = c.responses.create(
            model=SERVED_NAME, input="And of Germany?", previous_response_id=first.id, temperature=0
        )
        assert "Berlin" in second.output_text
        city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
        weather = {"type": "function", "name": "get_weather", "parameters": city}
        asked = c.responses.create(
            model=SERVED_NAME,
            input="What is the weather in Paris?",
            tools=[weather],
            tool_choice="required",
            temperature=0,
        )
        assert [(o.type, o.name, json.loads(o.arguments)) for o in asked.output] == [
            ("function_call", "get_weather", {"city": "Paris"})
        ]


class Person(pydantic.BaseModel):
    name: str
    age: int


PEOPLE = (
    ("John Smith is 31 years old.", Person(name="John Smith", age=31)),
    ("Maria is a 25 year old engineer from Madrid.", Person(name="Maria", age=25)),
)


def test_a_named_tool_choice_returns_the_object_instructor_asks_for_through_the_router(make_serve):
    """instructor's default tools mode forces a named tool (`tool_choice`), which needs no tool support in
    SmolLM2's template: the request it sends; instructor itself below."""
    tool = {"type": "function", "function": {"name": "Person", "parameters": Person.model_json_schema()}}
    for text, person in PEOPLE:
        r = client(make_serve.url).chat.completions.create(
            model=SERVED_NAME,
            messages=[{"role": "user", "content": f"Extract the person: {text}"}],
            tools=[tool],
            tool_choice={"type": "function", "function": {"name": "Person"}},
            temperature=0,
            max_tokens=100,
        )
        (call,) = r.choices[0].message.tool_calls
        assert Person.model_validate_json(call.function.arguments) == person


def test_instructor_in_its_default_tools_mode_returns_its_object_through_the_router(make_serve):
    import instructor  # installed by the Makefile beside its pins (see INSTRUCTOR there)

    c = instructor.from_openai(client(make_serve.url))
    for text, person in PEOPLE:
        got = c.chat.completions.create(
            model=SERVED_NAME,
            response_model=Person,
            messages=[{"role": "user", "content": f"Extract the person: {text}"}],
            temperature=0,
            max_tokens=100,
        )
        assert got.model_dump() == person.model_dump()


def test_the_agents_sdk_calls_a_function_tool_through_the_router(make_serve):
    """The SDK's default model (the Responses API): the agent's first turn calls the tool, whose result ends the run."""
    import agents  # openai-agents, a test dependency

    asked: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"It rains in {city}."

    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(openai.AsyncOpenAI(base_url=f"{make_serve.url}/v1", api_key="unused"))
    agent = agents.Agent(
        name="weather",
        tools=[get_weather],
        model=SERVED_NAME,
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
        tool_use_behavior="stop_on_first_tool",  # auto (the next turn) needs a template with tools: SmolLM2's has none
    )
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?"))
    assert asked == ["Paris"] and result.final_output == "It rains in Paris."


# Echoed prompt logprobs against transformers' log-softmax on the same (dequantised) weights. Measured on this
# CPU: equal (max |diff| 0.0); the tolerance leaves room for kernels that sum in another order (GPUs, bf16 aside).
PROMPT_LOGPROB_TOLERANCE = 1e-3


def test_echoed_prompt_logprobs_equal_transformers_monolithic_and_pd(ours, reference, mono, make_serve):
    """Log-likelihood scoring as evaluation harnesses do it: `echo` with `logprobs` and `max_tokens: 0`."""
    _, model = reference
    prompt = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome."
    ids = ours.encode(prompt)
    with torch.inference_mode():
        lps = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = lps[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    for url in (mono.url, make_serve.url):
        body = {"model": SERVED_NAME, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0}
        r = requests.post(f"{url}/v1/completions", json=body, timeout=scaled(300))
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        got = c["logprobs"]["token_logprobs"]
        assert c["text"] == prompt and got[0] is None and len(got) == len(ids)
        diff = max(abs(a - b) for a, b in zip(got[1:], expected, strict=True))
        print(f"SmolLM2 echoed prompt logprobs vs transformers, {url}: max |diff| {diff:.2e}")
        assert diff < PROMPT_LOGPROB_TOLERANCE
