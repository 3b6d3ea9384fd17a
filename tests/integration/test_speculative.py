"""Speculative decoding (NGRAM) on SmolLM2-135M-Instruct through real servers: the same chat answers, token for
token, with and without speculation, monolithic and through router + prefill + decode over Mooncake TCP (decode
speculates, prefill does not: n-gram drafts need no draft KV); greedy and seeded sampling; drafts were kept.

Real weights on a CPU: marked `real_model`. Three servers load at once, then each gets every prompt at once.
"""

from __future__ import annotations

import concurrent.futures as cf
import subprocess

import pytest
import requests

from disagg_worker.model.demo import SERVED_NAME
from tests.integration.procs import DISAGG, PDStack, Proc, scaled, serve, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.real_model]
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
        started.append(PDStack(str(model), decode_flags=NGRAM))
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
