"""Speculative decoding (NGRAM) through real servers: on SmolLM2-135M-Instruct the same chat answers, token for
token, with and without speculation, monolithic and through router + prefill + decode over Mooncake TCP (decode
speculates, prefill does not: n-gram drafts need no draft KV), greedy and seeded; on the tiny model the same
tokens from tensor- and pipeline-parallel instances, and every rank clean after a thousand abandoned requests.
Each test also checks that drafts were kept, so none passes by never speculating.

SmolLM2 (real weights on a CPU) is marked `real_model`; its three servers load at once, then each gets every
prompt at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import random
import subprocess

import pytest
import requests

from disagg_worker.model.demo import SERVED_NAME
from tests.integration.procs import DISAGG, PDStack, Proc, scaled, serve, wait_until
from tests.integration.test_parallel import PATIENT, abandon_requests, rank_queues
from tests.integration.test_pd import FLAGS, assert_clean

pytestmark = pytest.mark.integration
NGRAM = ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5")
PARAGRAPH = (
    "A Service gives a stable address to a set of pods selected by labels. The kube-proxy on every node turns "
    "that address into rules that pick one of the pods for each new connection."
)
CODE = "def area(width, height):\n    return width * height\n\n\nprint(area(3, 4))\n"
CHATS = [
    f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
    f"Rename the function area to surface in this code and show the whole code again:\n\n{CODE}",
    f"Quote the second sentence of this text back to me:\n\n{PARAGRAPH}",
    "Write a short poem about the sea.",
    "What is the capital of France?",
]
MAX_TOKENS = 64


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(plain monolithic, NGRAM monolithic, P/D stack whose decode speculates), all Ready."""
    model = tmp_path_factory.mktemp("models") / SERVED_NAME
    subprocess.run([DISAGG, "model", "convert-gguf", "--out", str(model)], check=True, timeout=scaled(300))
    started: list[Proc | PDStack] = []
    try:
        started.append(serve(str(model), "--served-model-name", "tiny"))
        started.append(serve(str(model), "--served-model-name", "tiny", *NGRAM))
        # Decode's waiting timeout far away: it counts prefill's queue, which the module's concurrent prompts fill
        # (over 8 s on a loaded machine); no test here is about a timeout.
        patient = ("--waiting-timeout", f"{scaled(60):g}")
        started.append(PDStack(str(model), decode_flags=(*NGRAM, *patient)))
        plain, spec = (p.wait_healthy(timeout=300) for p in started[:2])
        stack = started[2]
        assert isinstance(stack, PDStack)
        yield plain, spec, stack.wait_healthy()
    finally:
        for p in started:
            p.stop()


def chat(url: str, content: str, **sampling: object) -> str:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS, **sampling}
    r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=scaled(300))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def answers(url: str, **sampling: object) -> list[str]:
    """Every chat at once, so the server batches drafted and undrafted requests together."""
    with cf.ThreadPoolExecutor(len(CHATS)) as pool:
        return list(pool.map(lambda c: chat(url, c, **sampling), CHATS))


def accepted(url: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=scaled(10)).text
    total = "disagg_spec_accepted_tokens_total "
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(total))


@pytest.mark.real_model
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 11}], ids=["greedy", "seeded"])
def test_speculation_changes_no_answer_monolithic_or_through_pd(servers, sampling):
    plain, spec, stack = servers
    before = accepted(spec.url), accepted(stack.decode.url)
    want = answers(plain.url, **sampling)
    assert answers(spec.url, **sampling) == want
    assert answers(stack.router.url, **sampling) == want
    if not sampling.get("temperature"):
        assert PARAGRAPH.split(".")[0] in want[0]  # the model did quote: drafts had something to match
    # Drafts were kept, on the monolithic server and on decode (its metrics come with its next report, every
    # half second); prefill never drafts.
    wait_until(lambda: accepted(spec.url) > before[0], 10, what="accepted drafts on the monolithic server")
    wait_until(lambda: accepted(stack.decode.url) > before[1], 10, what="accepted drafts on decode")
    assert accepted(stack.prefill.url) == 0


# ---- the tiny model: ranks and aborts ------------------------------------------------------------------------


def repetitive_prompts(n: int) -> list[list[int]]:
    rng = random.Random(5)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(10, 2000) for _ in range(rng.choice([5, 9, 14]))]
        out.append((phrase * 5)[: rng.choice([25, 40, 60])])
    return out


def generate(url: str, ids: list[int], n: int = 40) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    r = requests.post(f"{url}/generate", json=body, timeout=scaled(120))
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def generate_all(url: str, prompts: list[list[int]]) -> list[list[int]]:
    with cf.ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda p: generate(url, p), prompts))


def plain_tokens(model: str, prompts: list[list[int]]) -> list[list[int]]:
    """The greedy tokens of a single-rank server without speculation."""
    plain = serve(model, *FLAGS).wait_healthy()
    try:
        return generate_all(plain.url, prompts)
    finally:
        plain.stop()


@pytest.mark.parametrize("ranks", [("--tp-size", "2"), ("--pp-size", "2")], ids=["tp2", "pp2"])
def test_speculative_ranks_equal_a_plain_single_rank(tiny_model, ranks):
    prompts = repetitive_prompts(12)
    expected = plain_tokens(tiny_model, prompts)
    spec = serve(tiny_model, *FLAGS, *NGRAM, *ranks).wait_healthy()
    try:
        assert generate_all(spec.url, prompts) == expected
        wait_until(lambda: accepted(spec.url) > 0, 10, what="accepted drafts")
        assert_clean(spec.url)
    finally:
        spec.stop()


def test_a_thousand_abandoned_requests_to_a_speculating_decode_leave_every_rank_clean(tiny_model):
    """Decode TP=2 speculating behind a plain prefill: clients give up at random moments; afterwards every
    queue is empty and every page free on every rank, and fresh requests get the plain tokens."""
    prompts = repetitive_prompts(8)
    expected = plain_tokens(tiny_model, prompts)
    stack = PDStack(tiny_model, *FLAGS, decode_flags=(*NGRAM, "--tp-size", "2")).wait_healthy()
    try:
        outcomes = asyncio.run(abandon_requests(stack.router.url, n=1000, seed=4))
        assert outcomes["patient_completed"] == 1000 // PATIENT, outcomes
        assert outcomes["aborted"] >= 300, outcomes
        wait_until(lambda: accepted(stack.decode.url) > 0, 10, what="accepted drafts on decode")
        assert_clean(stack.prefill.url, stack.decode.url)
        ranks = rank_queues(stack.decode.url)
        assert len(ranks) == 2 and all(not any(r["queues"].values()) for r in ranks), ranks
        assert generate_all(stack.router.url, prompts) == expected
    finally:
        stack.stop()


def completion(url: str, prompt: list[int], **extra: object) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0, "logprobs": 1, **extra}
    r = requests.post(f"{url}/v1/completions", json=body, timeout=scaled(120))
    assert r.status_code == 200, r.text
    return r.json()


def chunks(url: str, prompt: list[int]) -> list[tuple[str, list[str]]]:
    """The streamed answer as (text, token strings) per chunk: a verified draft's tokens come in one chunk."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "temperature": 0, "logprobs": 1, "stream": True}
    out = []
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=scaled(120)) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                choice = json.loads(line[6:])["choices"][0]
                if choice["logprobs"] and choice["logprobs"]["tokens"]:
                    out.append((choice["text"], choice["logprobs"]["tokens"]))
    return out


def test_a_stop_string_ends_a_speculative_answer_where_it_ends_a_plain_one(tiny_model):
    """A stop string completed by the first token of a verified draft's several: text, token count and logprobs
    end there, as one token at a time would end them; the draft's later tokens are neither counted nor shown."""
    plain = serve(tiny_model, *FLAGS, "--served-model-name", "tiny")
    spec = serve(tiny_model, *FLAGS, "--served-model-name", "tiny", *NGRAM)
    try:
        plain.wait_healthy(), spec.wait_healthy()
        tried = 0
        for prompt in repetitive_prompts(12):
            streamed = chunks(spec.url, prompt)
            run = next((i for i, (_, tokens) in enumerate(streamed) if len(tokens) >= 3), None)
            if run is None:
                continue
            # The answer's text up to the run's first token: it first occurs exactly there.
            stop = "".join(text for text, _ in streamed[:run]) + streamed[run][1][0]
            if not stop.strip():
                continue
            tried += 1
            want, got = completion(plain.url, prompt, stop=[stop]), completion(spec.url, prompt, stop=[stop])
            assert got["choices"][0]["text"] == want["choices"][0]["text"]
            assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"] == "stop"
            for key in ("prompt_tokens", "completion_tokens"):
                assert got["usage"][key] == want["usage"][key], key
            got_lp, want_lp = got["choices"][0]["logprobs"], want["choices"][0]["logprobs"]
            assert got_lp["tokens"] == want_lp["tokens"]
            assert got_lp["token_logprobs"] == pytest.approx(want_lp["token_logprobs"], abs=1e-4)
        assert tried >= 3, "too few answers with a verified draft of three tokens or more"
    finally:
        plain.stop()
        spec.stop()
