"""P/D through a gateway: a client (here the official `openai` client, as a gateway would pass its request on
after its endpoint picker chose) sends to a DECODE instance directly, naming the prefill in llm-d's header
`x-prefiller-host-port`; the decode performs the hand-off itself (`router/decode_handoff.py`).

One prefill, one decode and a monolithic server for reference, no router. The prefill streams prompts of 40+
tokens layer group by layer group and stalls such a forward while the test's release file is missing, so that a
test can kill it while it holds a request (the file exists otherwise: nothing stalls)."""

from __future__ import annotations

import concurrent.futures as cf
import re
import time
from pathlib import Path

import openai
import pytest
import requests

from tests.integration.procs import FAST_FAILURE, Proc, free_port, report_after, scaled, serve, wait_until
from tests.integration.test_pd import LAYERWISE, assert_clean
from tests.integration.test_pd_faults import STALLED, stall_env

pytestmark = pytest.mark.integration
FLAGS = ("--page-size", "4", "--chunk-size", "32", "--max-total-tokens", "8192", "--served-model-name", "tiny")
HEADER = "x-prefiller-host-port"
USER = [{"role": "user", "content": "Tell me a story about the sea."}]
LONG_PROMPT = list(range(100, 160))  # 60 tokens: streamed by layer group, so a stalled prefill holds it


class PD:
    """The prefill and decode processes, and the file whose absence stalls the prefill's streamed forwards."""

    def __init__(self, model: str, release: Path):
        self.model, self.release = model, release
        self.bootstrap_port = free_port()
        self.prefill = self.start_prefill()
        port = free_port()
        # The decode learns the prefills' bootstrap port as the router does: one port for every prefill.
        args = ["decode", "--model", model, "--port", str(port), *FLAGS, *FAST_FAILURE]
        self.decode = Proc([*args, "--bootstrap-port", str(self.bootstrap_port)], port)

    def start_prefill(self, port: int | None = None) -> Proc:
        port = port or free_port()
        args = ["prefill", "--model", self.model, "--port", str(port), "--bootstrap-port", str(self.bootstrap_port)]
        return Proc([*args, *FLAGS, *FAST_FAILURE, *LAYERWISE], port, stall_env(self.release))

    @property
    def named(self) -> str:
        return f"127.0.0.1:{self.prefill.port}"


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory):
    release = tmp_path_factory.mktemp("handoff") / "release"
    release.touch()
    s = PD(tiny_model, release)
    try:
        s.prefill.wait_healthy()
        s.decode.wait_healthy()
        yield s
    finally:
        release.touch()
        s.decode.stop()
        s.prefill.stop()


@pytest.fixture(scope="module")
def mono(tiny_model):
    p = serve(tiny_model, *FLAGS).wait_healthy()
    yield p
    p.stop()


def client(url: str, headers: dict[str, str] | None = None) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=scaled(60), default_headers=headers
    )


def metric(url: str, name: str) -> float:
    """The sum of a series' samples on an instance's /metrics."""
    text = requests.get(f"{url}/metrics", timeout=scaled(5)).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def transfers(url: str) -> int:
    return requests.get(f"{url}/health", timeout=scaled(5)).json()["transfer"]["transfers"]


def answers(c: openai.OpenAI) -> dict[str, str]:
    """Greedy chat and completions, whole and streamed."""
    out = {}
    for stream in (False, True):
        chat = c.chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=0, stream=stream)
        done = c.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0, stream=stream
        )
        if stream:
            out["chat stream"] = "".join(ch.choices[0].delta.content or "" for ch in chat if ch.choices)
            out["completion stream"] = "".join(ch.choices[0].text for ch in done if ch.choices)
        else:
            out["chat"] = chat.choices[0].message.content or ""
            out["completion"] = done.choices[0].text
    return out


def test_the_openai_client_to_a_decode_naming_its_prefill_gets_monolithic_answers_through_pd(pd, mono):
    prompt_tokens, moved = metric(pd.prefill.url, "disagg_prompt_tokens_total"), transfers(pd.decode.url)
    got = answers(client(pd.decode.url, {HEADER: pd.named}))
    assert got == answers(client(mono.url))
    assert all(got.values()), got
    # P/D visible: the prefill computed the prompts and decode received their KV, one transfer per request (as its
    # scheduler's next report, every half second, tells /health).
    assert metric(pd.prefill.url, "disagg_prompt_tokens_total") > prompt_tokens
    wait_until(lambda: transfers(pd.decode.url) >= moved + 4, timeout=scaled(10), what="decode's four transfers")
    assert_clean(pd.decode.url, pd.prefill.url)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_handed_off_stream_ends_with_done(pd, path):
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "stream": True}
    body.update({"messages": USER} if "chat" in path else {"prompt": "Once upon a time"})
    r = requests.post(f"{pd.decode.url}{path}", json=body, headers={HEADER: pd.named}, timeout=scaled(60))
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    events = [line for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 2
    assert '"error"' not in r.text


def test_n_choices_and_generate_are_handed_off_too(pd, mono):
    expected = client(mono.url).completions.create(model="tiny", prompt="Hi", max_tokens=5, temperature=0)
    got = client(pd.decode.url, {HEADER: pd.named}).completions.create(
        model="tiny", prompt="Hi", max_tokens=5, temperature=0, n=2
    )
    assert [c.text for c in got.choices] == [expected.choices[0].text] * 2
    body = {"input_ids": LONG_PROMPT[:10], "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    r = requests.post(f"{pd.decode.url}/generate", json=body, headers={HEADER: pd.named}, timeout=scaled(60))
    ref = requests.post(f"{mono.url}/generate", json=body, timeout=scaled(60))
    assert r.status_code == 200 and r.json()["output_ids"] == ref.json()["output_ids"]


def test_without_the_header_a_decode_serves_as_it_always_did(pd):
    r = requests.post(f"{pd.decode.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=scaled(30))
    assert r.status_code == 400 and "bootstrap_room" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "value,says",
    [
        ("nonsense", "must be host:port"),
        ("127.0.0.1:99999", "port from 1 to 65535"),
        ("10.1.2.3:8000", "--prefill-allow does not admit"),  # not loopback: the default admits nothing else
        ("169.254.169.254:80", "--prefill-allow does not admit"),
    ],
)
def test_a_bad_or_foreign_header_is_a_400_naming_it(pd, value, says):
    c = client(pd.decode.url, {HEADER: value})
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="Hi", max_tokens=3)
    assert e.value.status_code == 400 and e.value.body["param"] == HEADER
    assert HEADER in e.value.body["message"] and says in e.value.body["message"]


def test_the_responses_api_is_not_handed_off(pd):
    r = requests.post(
        f"{pd.decode.url}/v1/responses", json={"input": "Hi"}, headers={HEADER: pd.named}, timeout=scaled(30)
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == HEADER


def test_a_prefills_own_refusal_passes_through(pd):
    c = client(pd.decode.url, {HEADER: pd.named})
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="Hi", max_tokens=3, temperature=-1)
    assert e.value.body["param"] == "temperature"


def test_an_unreachable_prefill_is_a_502_naming_the_request(pd):
    nobody = free_port()  # nothing listens there
    r = requests.post(
        f"{pd.decode.url}/v1/completions",
        json={"prompt": "Hi", "max_tokens": 3},
        headers={HEADER: f"127.0.0.1:{nobody}", "X-Request-Id": "gw-unreachable-1"},
        timeout=scaled(60),
    )
    assert r.status_code == 502, r.text
    assert "request gw-unreachable-1" in r.json()["error"]["message"]
    assert "prefill" in r.json()["error"]["message"]
    assert_clean(pd.decode.url)


def stalls(proc: Proc) -> int:
    return Path(proc.log.name).read_text(errors="replace").count(STALLED)


def test_a_prefill_killed_while_it_holds_the_request_fails_it_cleanly_and_decode_frees_everything(pd):
    seen = stalls(pd.prefill)
    pd.release.unlink()
    body = {"prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0}
    headers = {HEADER: pd.named, "X-Request-Id": "gw-killed-1"}
    with cf.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(
            requests.post, f"{pd.decode.url}/v1/completions", json=body, headers=headers, timeout=scaled(60)
        )
        wait_until(lambda: stalls(pd.prefill) > seen, timeout=scaled(30), interval=0.05, what="prefill stalled")
        stalled = time.time()
        holding = report_after(pd.decode.url, stalled, lambda st: st["pages_used"] > 0, scaled(30), "holding pages")
        pd.prefill.kill()
        pd.release.touch()
        r = answer.result(timeout=scaled(60))
    assert holding["pages_used"] > 0  # decode held the request's pages when its prefill died
    assert 500 <= r.status_code < 600, r.text
    assert "request gw-killed-1" in r.json()["error"]["message"]
    assert_clean(pd.decode.url)
    pd.prefill = pd.start_prefill(pd.prefill.port).wait_healthy()
    # The same decode hands off to the restarted prefill as before.
    again = client(pd.decode.url, {HEADER: pd.named}).completions.create(model="tiny", prompt="Hi", max_tokens=3)
    assert again.choices[0].text
