"""P/D through a gateway: a client (here the official `openai` client, as a gateway would pass its request on
after its endpoint picker chose) sends to a DECODE instance directly, naming the prefill in llm-d's header
`x-prefiller-host-port`; the decode performs the hand-off itself (`router/decode_handoff.py`).

One prefill, one decode and a monolithic server for reference, no router. The prefill streams prompts of 40+
tokens layer group by layer group and stalls such a forward while the test's release file is missing, so that a
test can kill it while it holds a request (the file exists otherwise: nothing stalls)."""

from __future__ import annotations

import concurrent.futures as cf
import random
import re
import time
from pathlib import Path

import openai
import pytest
import requests

from disagg_worker import keys
from tests.integration.procs import FAST_FAILURE, Proc, free_port, report_after, scaled, serve, wait_until
from tests.integration.test_pd import LAYERWISE, assert_clean
from tests.integration.test_pd_faults import STALLED, stall_env

pytestmark = pytest.mark.integration
FLAGS = ("--page-size", "4", "--chunk-size", "32", "--max-total-tokens", "8192", "--served-model-name", "tiny")
HEADER = "x-prefiller-host-port"
USER = [{"role": "user", "content": "Tell me a story about the sea."}]
SECRET, CLIENT_KEY = "the-models-secret", "a-clients-key"
KEY_FLAGS = ("--api-key", CLIENT_KEY)
LONG_PROMPT = list(range(100, 160))  # 60 tokens: streamed by layer group, so a stalled prefill holds it


class PD:
    """The prefill and decode processes, and the file whose absence stalls the prefill's streamed forwards."""

    def __init__(self, model: str, release: Path, *flags: str, decode_flags: tuple[str, ...] = ()):
        self.model, self.release, self.flags = model, release, flags
        self.bootstrap_port = free_port()
        self.prefill = self.start_prefill()
        port = free_port()
        # The decode learns the prefills' bootstrap port as the router does: one port for every prefill.
        args = ["decode", "--model", model, "--port", str(port), *FLAGS, *FAST_FAILURE]
        self.decode = Proc([*args, *flags, *decode_flags, "--bootstrap-port", str(self.bootstrap_port)], port)

    def start_prefill(self, port: int | None = None) -> Proc:
        port = port or free_port()
        args = ["prefill", "--model", self.model, "--port", str(port), "--bootstrap-port", str(self.bootstrap_port)]
        return Proc([*args, *FLAGS, *FAST_FAILURE, *LAYERWISE, *self.flags], port, stall_env(self.release))

    @property
    def named(self) -> str:
        return f"127.0.0.1:{self.prefill.port}"


def running(s: PD):
    try:
        s.prefill.wait_healthy()
        s.decode.wait_healthy()
        yield s
    finally:
        s.release.touch()
        s.decode.stop()
        s.prefill.stop()


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory):
    release = tmp_path_factory.mktemp("handoff") / "release"
    release.touch()
    yield from running(PD(tiny_model, release))


@pytest.fixture(scope="module")
def authed(tiny_model, tmp_path_factory):
    """Prefill and decode with the model's secret (the prefill takes nothing but the router's worker token), the
    decode also with a client's API key."""
    where = tmp_path_factory.mktemp("handoff-auth")
    (where / "release").touch()
    (where / "secret").write_text(SECRET)
    s = PD(tiny_model, where / "release", "--auth-token-file", str(where / "secret"), decode_flags=KEY_FLAGS)
    yield from running(s)


@pytest.fixture(scope="module")
def mono(tiny_model):
    p = serve(tiny_model, *FLAGS).wait_healthy()
    yield p
    p.stop()


def client(url: str, headers: dict[str, str] | None = None, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=scaled(60), default_headers=headers)


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


def test_with_the_models_secret_the_legs_are_authenticated_as_the_routers(authed, mono):
    """The client presents its API key to decode; the prefill, which takes only the worker token, answers the
    hand-off's leg, and decode takes the bootstrap target the hand-off signed (an unsigned one it refuses)."""
    c = client(authed.decode.url, {HEADER: authed.named}, key=CLIENT_KEY)
    got = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0)
    expected = client(mono.url).completions.create(model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert got.choices[0].text == expected.choices[0].text
    with pytest.raises(openai.AuthenticationError):
        client(authed.prefill.url, key=CLIENT_KEY).completions.create(model="tiny", prompt="Hi", max_tokens=2)
    decode_idle(authed)


def decode_idle(p: PD) -> None:
    """Decode holds no request and no page (its /health, open without a key, says; it keeps no prefix cache)."""

    def idle() -> bool:
        load = requests.get(f"{p.decode.url}/health", timeout=scaled(5)).json().get("load", {})
        return load.get("requests") == 0 and load.get("kv_used") == 0

    wait_until(idle, timeout=scaled(30), what="decode idle, every page free")


def sidecar(p: PD, body: dict, signed: bool) -> requests.Response:
    """What llm-d's routing sidecar does for SGLang: the same body with the bootstrap fields to the prefill and to
    the decode at once, the decode's answer the client's (signed as docs/routing.md says, or not)."""
    room = random.getrandbits(63)
    target = {"bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port, "bootstrap_room": room}
    if signed:
        target["bootstrap_sig"] = keys.sign_target(
            keys.derive(SECRET, keys.TARGET), "127.0.0.1", p.bootstrap_port, room
        )
    worker = {"Authorization": f"Bearer {keys.derive(SECRET, keys.WORKER)}"}
    leg = {**body, **target}
    with cf.ThreadPoolExecutor(2) as pool:
        prefill = pool.submit(requests.post, f"{p.prefill.url}/v1/completions", json=leg, headers=worker, timeout=60)
        decode = pool.submit(requests.post, f"{p.decode.url}/v1/completions", json=leg, headers=worker, timeout=60)
        answer = decode.result(timeout=scaled(60))
        prefill.result(timeout=scaled(60))
    return answer


def test_a_sidecar_that_calls_prefill_itself_drives_the_pair_with_the_bootstrap_fields_in_the_body(authed, mono):
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    expected = requests.post(f"{mono.url}/v1/completions", json=body, timeout=scaled(60)).json()
    r = sidecar(authed, body, signed=True)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected["choices"][0]["text"]
    refused = sidecar(authed, body, signed=False)
    assert refused.status_code == 403 and "not signed" in refused.json()["error"]["message"]
    decode_idle(authed)
