"""A client of the router that stops reading its stream is disconnected, and its choices are aborted upstream.

One prefill and one decode behind a router with a short --client-write-timeout. A raw socket client with a tiny
receive buffer sends a long streamed request (n = 4, and n = 1), reads its first event and then reads nothing:
once the router's buffers towards it are full, a write waits for a client that takes no bytes. Within the write
timeout (and the moment the decode takes to abort) the decode runs nothing and holds no page, although the
answers asked for would keep it busy far longer; the router answers the next client as usual.
"""

from __future__ import annotations

import json
import socket
import time

import pytest
import requests

from tests.integration.procs import PDStack, idle, report_after, scaled

pytestmark = pytest.mark.integration
WRITE_TIMEOUT_S = 2.0  # --client-write-timeout, scaled below
# The decode's running count back to 0 and every page free this long after it reported the request running: the
# router's buffers fill within a few hundred tokens (how long that takes is how fast the machine decodes: over 6 s on
# a loaded 2-core machine), then the write timeout, then the decode's abort. Still far below the time the answer
# takes to finish, and `cut_off` asserts it did not (no [DONE]).
FREED_S = WRITE_TIMEOUT_S + 20.0
# Each choice asks for nearly the whole context, ignoring EOS: on this tiny model many times FREED_S of decoding.
MAX_TOKENS = 4000
N = 4
# Each token's event carries its 20 likeliest alternatives (over a kilobyte): the buffers between the router and
# the client (the kernel's, up to megabytes) fill within seconds.
LARGE_EVENTS = {"logprobs": True, "top_logprobs": 20}
FLAGS = ("--page-size", "4", "--chunk-size", "32", "--max-total-tokens", str(N * (MAX_TOKENS + 96)))


@pytest.fixture(scope="module")
def stack(tiny_model):
    s = PDStack(tiny_model, *FLAGS, router_flags=("--client-write-timeout", f"{scaled(WRITE_TIMEOUT_S):g}"))
    yield s.wait_healthy()
    s.stop()


def stop_reading(port: int, body: dict) -> socket.socket:
    """Send `body` as a streamed chat completion from a socket with a tiny receive buffer, read up to the end of the
    first event, and return the socket, which reads nothing more."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connecting: the window it announces stays small
    s.settimeout(scaled(60))
    s.connect(("127.0.0.1", port))
    payload = json.dumps({**body, "stream": True}).encode()
    head = "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    s.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    got = b""
    while b"data: " not in got or b"\n\n" not in got.partition(b"data: ")[2]:
        chunk = s.recv(256)
        assert chunk, f"the router closed the stream before its first event: {got!r}"
        got += chunk
    assert got.startswith(b"HTTP/1.1 200"), got
    return s


def cut_off(s: socket.socket) -> bool:
    """Whether the router closed the connection with the answer unfinished: reading what is left reaches the
    connection's end without a [DONE] (a finished answer leaves the connection open for the next request)."""
    s.settimeout(scaled(10))
    rest = b""
    try:
        while chunk := s.recv(65536):
            rest += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return b"data: [DONE]" not in rest


@pytest.mark.parametrize("n", [N, 1])
def test_a_client_that_stops_reading_is_disconnected_and_its_choices_free_their_pages(stack, n):
    body = {
        "messages": [{"role": "user", "content": "The sea"}],
        "n": n,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 1.0,
        **LARGE_EVENTS,
    }
    asked = time.time()
    client = stop_reading(stack.router.port, body)
    try:
        running = report_after(stack.decode.url, asked, lambda st: st["running"] == n, 60, f"running {n}")
        freed = report_after(
            stack.decode.url,
            running["time"],
            lambda st: idle(st) and st["pages_used"] == 0,
            FREED_S,
            "idle, every page free",
        )
        print(f"n = {n}: the decode idle {freed['time'] - running['time']:.1f} s after it ran the request")
        assert cut_off(client), "the router closed the client's connection mid-answer"
    finally:
        client.close()
    r = requests.post(
        f"{stack.router.url}/v1/completions",
        json={"prompt": "Once upon a time", "max_tokens": 4, "ignore_eos": True},
        timeout=scaled(30),
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
