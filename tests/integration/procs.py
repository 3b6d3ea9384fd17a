"""Start real `disagg` processes on localhost for integration tests."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import requests

from tests.timing import scaled, wait_until

__all__ = ["wait_until", "scaled"]

DISAGG = str(Path(sys.executable).with_name("disagg"))


# Ports handed to servers come from below the kernel's ephemeral range (32768+, where every
# outgoing connection, gloo and zmq take theirs) and above Mooncake's own (15000-17000): a port
# the kernel lends an outgoing socket between our check and the server's bind would make that
# server fail with "address already in use".
PORT_RANGE = range(20000, 32000)
_given: set[int] = set()


def worker_ports(ports: range, worker: str, workers: str) -> range:
    """The share of `ports` of one pytest-xdist worker (`worker`: PYTEST_XDIST_WORKER, "gw0".., "" outside
    xdist; `workers`: PYTEST_XDIST_WORKER_COUNT). Workers are separate processes, each with its own `_given`:
    a port one has given to a server still starting is free to bind for another, so each hands out its own."""
    if not worker:
        return ports
    index, count = int(worker.removeprefix("gw")), int(workers)
    share = len(ports) // count
    return ports[index * share : (index + 1) * share]


def free_port() -> int:
    """A port no server here was given yet and nothing listens on now (in this pytest worker's share)."""
    rng = random.Random()
    mine = worker_ports(
        PORT_RANGE, os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")
    )
    while True:
        port = rng.choice(mine)
        if port in _given or not bindable(port):
            continue
        _given.add(port)
        return port


def bindable(port: int, host: str = "127.0.0.1") -> bool:
    """Whether nothing holds `port` on `host` now (a listener, or an outgoing connection's local port)."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class Proc:
    """A `disagg` subcommand running in its own process group; logs go to a temp file."""

    started: list[Proc] = []  # every one, so that none outlives its test module (conftest.py)

    def __init__(self, args: list[str], port: int, env: dict | None = None):
        Proc.started.append(self)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix="disagg-", suffix=".log", delete=False)
        full_env = {**os.environ, "MC_LOG_LEVEL": "WARNING", **(env or {})}
        self.proc = subprocess.Popen(
            [DISAGG, *args], stdout=self.log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )

    def wait_healthy(self, timeout: float = 180.0) -> Proc:
        timeout = scaled(timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"process exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.3)
        logs = self.logs()
        self.stop()  # a test that fails here must not leave the process (and its ranks) running
        raise TimeoutError(f"{self.url} not healthy after {timeout}s:\n{logs}")

    def logs(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-5000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(scaled(timeout))
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def signal(self, sig: int) -> None:
        """Signal the main process only, as Kubernetes does a container's PID 1."""
        os.kill(self.proc.pid, sig)

    def wait_exit(self, timeout: float) -> int:
        return self.proc.wait(scaled(timeout))


def serve(model: str, *extra: str, port: int | None = None, env: dict | None = None) -> Proc:
    port = port or free_port()
    return Proc(["serve", "--model", model, "--port", str(port), *extra], port, env)


def report_after(url: str, since: float, pred: Callable[[dict], bool], timeout: float, what: str) -> dict:
    """The first scheduler report made after `since` (a `time.time()`) for which `pred` holds. /stats serves the
    latest report, which the scheduler sends every half second: an older one may show a state already gone
    (idle before the request came, pages free before they were taken)."""
    seen: list[dict] = []

    def fresh() -> dict | None:
        r = requests.get(f"{url}/stats", timeout=scaled(5))
        if not r.ok:  # 503 until the scheduler's first report
            return None
        seen[:] = [r.json()]
        return seen[0] if seen[0]["time"] > since and pred(seen[0]) else None

    try:
        return wait_until(fresh, timeout, interval=0.1, what=f"{url} {what}")
    except TimeoutError as e:
        raise TimeoutError(f"{e}; last report: {seen}") from None


def idle(st: dict) -> bool:
    return st["running"] == 0 and st["waiting"] == 0 and not any(st["queues"].values())


def idle_now(url: str, timeout: float = 60) -> dict:
    """A report made after this call that shows the instance idle: what it held until now has ended."""
    return report_after(url, time.time(), idle, timeout, "idle")


def idle_and_flushed(url: str, timeout: float = 60) -> dict:
    """Wait until a report made after this call shows the instance idle, flush its prefix cache, and return the
    first report made after the flush that shows every page free (the caller asserts on its accounting)."""
    idle_now(url, timeout)
    flushed = time.time()
    requests.post(f"{url}/flush_cache", timeout=scaled(5))
    return report_after(url, flushed, lambda st: idle(st) and st["pages_used"] == 0, timeout, "idle, every page free")


# Failures are detected in seconds, not in the defaults' minutes; scaled, so that a loaded machine's slowness
# is not taken for a failure. The bootstrap timeout also covers what decode does before it sends a destination
# (compiling a request's grammar, waiting for pages): on a loaded 2-core machine that took over 5 s.
FAST_FAILURE = [
    "--bootstrap-timeout",
    f"{scaled(15):g}",
    "--waiting-timeout",
    f"{scaled(8):g}",
    "--heartbeat-interval",
    "0.5",
]


class PDStack:
    """A router in front of `prefills` prefill and `decodes` decode instances, each its own process.

    `prefill_flags` / `decode_flags` come after the shared flags and win over them; `router_flags`
    are added to the router's command line; `env` is added to the workers' environment, and `decode_envs[i]` to
    decode i's besides."""

    def __init__(
        self,
        model: str,
        *engine_flags: str,
        prefill_flags: tuple[str, ...] = (),
        decode_flags: tuple[str, ...] = (),
        router_flags: tuple[str, ...] = (),
        decodes: int = 1,
        env: dict | None = None,
        prefills: int = 1,
        decode_envs: tuple[dict, ...] = (),
    ):
        self.model = model
        self.env = env
        # Workers serve the model under the router's name, as `serve --local` and the operator start them, so a
        # client sending the listed model (the openai client always does) reaches them under that name.
        self.flags = ["--served-model-name", "tiny", *engine_flags, *FAST_FAILURE]
        self.prefill_flags, self.decode_flags = list(prefill_flags), list(decode_flags)
        self.bootstrap_ports = [free_port() for _ in range(prefills)]
        self.bootstrap_port = self.bootstrap_ports[0]
        self.prefills = [self.start_prefill(bootstrap_port=b) for b in self.bootstrap_ports]
        extra = [*decode_envs, *[{}] * decodes][:decodes]
        self.decodes = [self.start_decode(env=e) for e in extra]
        port = free_port()
        prefill_args = [
            a for p, b in zip(self.prefills, self.bootstrap_ports, strict=True) for a in ("--prefill", p.url, str(b))
        ]
        decode_args = [a for d in self.decodes for a in ("--decode", d.url)]
        self.router = Proc(
            [
                "router",
                "--port",
                str(port),
                "--served-model-name",
                "tiny",
                *prefill_args,
                *decode_args,
                "--health-interval",
                "0.5",
                *router_flags,
            ],
            port,
        )

    @property
    def prefill(self) -> Proc:
        return self.prefills[0]

    @prefill.setter
    def prefill(self, proc: Proc) -> None:
        self.prefills[0] = proc

    @property
    def decode(self) -> Proc:
        return self.decodes[0]

    @decode.setter
    def decode(self, proc: Proc) -> None:
        self.decodes[0] = proc

    def start_prefill(self, port: int | None = None, bootstrap_port: int | None = None) -> Proc:
        port = port or free_port()
        return Proc(
            [
                "prefill",
                "--model",
                self.model,
                "--port",
                str(port),
                "--bootstrap-port",
                str(bootstrap_port or self.bootstrap_port),
                *self.flags,
                *self.prefill_flags,
            ],
            port,
            self.env,
        )

    def start_decode(self, port: int | None = None, env: dict | None = None) -> Proc:
        port = port or free_port()
        args = ["decode", "--model", self.model, "--port", str(port), *self.flags, *self.decode_flags]
        return Proc(args, port, {**(self.env or {}), **(env or {})})

    def wait_healthy(self) -> PDStack:
        """Every process serves; if one does not, all are stopped (a failed start leaves nothing running)."""
        try:
            for p in self.prefills:
                p.wait_healthy()
            for d in self.decodes:
                d.wait_healthy()
            self.router.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for p in (self.router, *self.decodes, *self.prefills):
            p.stop()


def sse_stream(url: str, path: str, body: dict, timeout: float = 60.0):
    """An open SSE response and an iterator over its `data:` payloads (decoded JSON, or "[DONE]")."""
    r = requests.post(f"{url}{path}", json={**body, "stream": True}, stream=True, timeout=scaled(timeout))
    r.encoding = "utf-8"  # text/event-stream names no charset

    def events():
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("data: "):
                data = line[6:]
                yield data if data == "[DONE]" else json.loads(data)

    return r, events()


def greedy(url: str, ids: list[int], n: int = 12) -> list[int]:
    """The greedy output ids of one fresh request (the reference a fault must not change)."""
    r = requests.post(
        f"{url}/generate",
        json={"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}},
        timeout=scaled(120),
    )
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


REFERENCE_PROMPTS = [list(range(40 + 7 * i, 40 + 7 * i + 20 + 30 * i)) for i in range(4)]


def reference(url: str) -> list[list[int]]:
    """Greedy answers of a fixed set of fresh prompts; after a fault the same stack must give them again."""
    return [greedy(url, p) for p in REFERENCE_PROMPTS]


class Stream(threading.Thread):
    """One streaming request read on its own thread: its events, whether it started, when it ended.

    `error_events` are OpenAI error events; `done` is True when the stream ended with [DONE]; a
    dropped connection is kept in `dropped` (never a clean end); `headers` are the response's."""

    def __init__(self, url: str, path: str, body: dict, timeout: float = 120.0):
        super().__init__(daemon=True)
        self.url, self.path, self.body, self.timeout = url, path, body, timeout
        self.status = 0
        self.headers: Mapping[str, str] = {}
        self.body_text = ""
        self.events: list = []
        self.started = threading.Event()
        self.ended_at = 0.0
        self.dropped = ""
        self.start()

    def run(self) -> None:
        try:
            r, events = sse_stream(self.url, self.path, self.body, self.timeout)
            self.status, self.headers = r.status_code, r.headers
            if r.status_code != 200:
                self.body_text = r.text
                return
            for e in events:
                self.events.append(e)
                if isinstance(e, dict) and e.get("choices"):
                    self.started.set()
        except (requests.RequestException, ValueError) as e:
            self.dropped = repr(e)
        finally:
            self.ended_at = time.monotonic()
            self.started.set()

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    @property
    def error_events(self) -> list[dict]:
        return [e for e in self.events if isinstance(e, dict) and "error" in e]

    @property
    def usage(self) -> dict:
        return next((e["usage"] for e in reversed(self.events) if isinstance(e, dict) and e.get("usage")), {})
