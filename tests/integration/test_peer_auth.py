"""Peers prove who they are: a third process that reaches a running prefill's and decode's KV control ports
cannot steer a room. While real requests run, it sends forged hellos (reusing decode's endpoint, which used to
fail every room of that decode), forged room updates (which could end a room or release quarantined pages),
unsealed and oversized frames: every real request finishes with the tokens it has without the attack, both
instances stay healthy, and each counts the frames it dropped."""

from __future__ import annotations

import concurrent.futures as cf
import ipaddress
import random
import threading

import psutil
import pytest
import requests
import zmq

from disagg_worker import keys
from disagg_worker.disagg.channel import MAX_FRAME_BYTES, seal
from disagg_worker.disagg.messages import DecodeHello, RoomUpdate, encode
from tests.integration.procs import PDStack, Proc, free_port, greedy, wait_until
from tests.integration.test_pd import FLAGS
from tests.timing import scaled

pytestmark = pytest.mark.integration
SECRET = "the-models-secret"
WORKER = {"Authorization": f"Bearer {keys.derive(SECRET, keys.WORKER)}"}
PROMPTS = [list(range(100 + 11 * i, 100 + 11 * i + 30 + 7 * i)) for i in range(12)]


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    secret = tmp_path_factory.mktemp("auth") / "token"
    secret.write_text(SECRET + "\n")
    ports = free_port(), free_port()
    s = PDStack(
        tiny_model,
        *FLAGS,
        "--auth-token-file",
        str(secret),
        prefill_flags=("--control-port", str(ports[0])),
        decode_flags=("--control-port", str(ports[1])),
        router_flags=("--auth-token-file", str(secret)),
    ).wait_healthy()
    s.control_ports = ports
    yield s
    s.stop()


def forgeries(decode_endpoint: str) -> list[bytes]:
    """What a third party can send without the model's secret: sealed with keys it can guess, or not at all."""
    hello = DecodeHello(
        decode_id="forged",
        reply_endpoint=decode_endpoint,
        session_id="127.0.0.1:1",
        buffer_ptrs=[4096],
        buffer_nbytes=[4096],
        page_nbytes=64,
        start_layer=0,
        aux_item_nbytes=64,
    )
    room = random.getrandbits(63)
    update = RoomUpdate(room=room, tp_rank=0, pp_rank=0, status=4, reason="forged", quiesced=True, aux=b"")
    guesses = [keys.control_key(""), keys.control_key("secret"), b""]
    return [seal(k, encode(m)) for k in guesses for m in (hello, update)] + [encode(hello), encode(update)]


def attack(ports: tuple[int, int], stop: threading.Event, sent: list[int]) -> None:
    ctx = zmq.Context()
    socks = []
    for port in ports:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(b"\0" * (MAX_FRAME_BYTES + 1024))  # oversized: dropped unread
        socks.append(sock)
    decode_endpoint = f"tcp://127.0.0.1:{ports[1]}"
    while not stop.is_set():
        for sock in socks:
            for frame in forgeries(decode_endpoint):
                sock.send(frame)
                sent[0] += 1
        stop.wait(0.01)
    for sock in socks:
        sock.close()
    ctx.term()


def rejected(url: str, reason: str) -> float:
    text = requests.get(f"{url}/metrics", headers=WORKER, timeout=scaled(5)).text
    line = f'disagg_kv_control_frames_rejected_total{{reason="{reason}"}}'
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line))


def test_forged_control_frames_change_no_answer_and_are_counted(stack):
    expected = [greedy(stack.router.url, p) for p in PROMPTS]
    stop, sent = threading.Event(), [0]
    attacker = threading.Thread(target=attack, args=(stack.control_ports, stop, sent))
    attacker.start()
    try:
        wait_until(lambda: sent[0] > 50, timeout=10, interval=0.02, what="the attack under way")
        with cf.ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda p: greedy(stack.router.url, p), PROMPTS * 2))
    finally:
        stop.set()
        attacker.join()
    assert got == expected * 2
    for instance in (stack.prefill, stack.decode):
        assert requests.get(f"{instance.url}/health", timeout=scaled(5)).status_code == 200
        wait_until(
            lambda url=instance.url: rejected(url, "unauthenticated") >= 50 and rejected(url, "oversized") >= 1,
            timeout=10,
            what=f"{instance.url} counting the dropped frames",
        )


def test_a_local_stack_listens_on_loopback_only_but_for_mooncakes_own_ports(tiny_model):
    """`serve --local`: the router, the workers' HTTP ports, the bootstrap server and the KV control channels listen
    on loopback. Mooncake 0.3.13 binds its two ports per engine (RPC/handshake, TCP data) on every interface
    whatever address it is given (`MC_TCP_BIND_ADDRESS` only sets the one it advertises): they are the only
    exception, found in the window the test gives Mooncake, and docs/security.md says so."""
    low, high = 26000, 26100
    port = free_port()
    env = {"MC_MIN_RPC_PORT": str(low), "MC_MAX_RPC_PORT": str(high)}
    stack = Proc(["serve", "--local", "--model", tiny_model, "--port", str(port)], port, env)
    try:
        stack.wait_healthy()
        tree = [psutil.Process(stack.proc.pid), *psutil.Process(stack.proc.pid).children(recursive=True)]
        listening = {
            (c.laddr.ip, c.laddr.port) for p in tree for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN
        }
        exposed = {(ip, p) for ip, p in listening if not ipaddress.ip_address(ip).is_loopback}
        assert len(listening) > len(exposed) >= 2, listening  # the loopback ones are there too
        assert all(low <= p <= high for _, p in exposed), f"listening outside loopback: {sorted(exposed)}"
    finally:
        stack.stop()
