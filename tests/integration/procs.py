"""Start real `disagg` processes on localhost for integration tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

DISAGG = str(Path(sys.executable).with_name("disagg"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A `disagg` subcommand running in its own process group; logs go to a temp file."""

    def __init__(self, args: list[str], port: int, env: dict | None = None):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix="disagg-", suffix=".log", delete=False)
        full_env = {**os.environ, "MC_LOG_LEVEL": "WARNING", **(env or {})}
        self.proc = subprocess.Popen(
            [DISAGG, *args], stdout=self.log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )

    def wait_healthy(self, timeout: float = 180.0) -> Proc:
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
        raise TimeoutError(f"{self.url} not healthy after {timeout}s:\n{self.logs()}")

    def logs(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-5000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode

    def kill(self) -> None:
        self.stop(signal.SIGKILL)


def serve(model: str, *extra: str, port: int | None = None) -> Proc:
    port = port or free_port()
    return Proc(["serve", "--model", model, "--port", str(port), *extra], port)


def wait_until(pred, timeout: float = 30.0, interval: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise TimeoutError(f"{what} not reached in {timeout}s (last: {last!r})")


def idle_and_flushed(url: str, timeout: float = 30.0) -> dict:
    """Wait until the instance is idle, flush its prefix cache, and return its page accounting."""
    seen: list[dict] = []

    def idle():
        st = requests.get(f"{url}/stats", timeout=5).json()
        seen[:] = [st]
        return st if st["running"] == 0 and st["waiting"] == 0 and not any(st["queues"].values()) else None

    try:
        wait_until(idle, timeout, what=f"{url} idle")
    except TimeoutError as e:
        raise TimeoutError(f"{e}; last report: {seen}") from None
    requests.post(f"{url}/flush_cache", timeout=5)

    def flushed():
        st = requests.get(f"{url}/stats", timeout=5).json()
        seen[:] = [st]
        return st if st["pages_used"] == 0 else None

    try:
        return wait_until(flushed, timeout, what=f"{url} pages freed")
    except TimeoutError as e:
        raise TimeoutError(f"{e}; last report: {seen}") from None


FAST_FAILURE = ["--bootstrap-timeout", "5", "--waiting-timeout", "8", "--heartbeat-interval", "0.5"]


class PDStack:
    """A router in front of one prefill and one decode instance, each its own process."""

    def __init__(self, model: str, *engine_flags: str, prefill_flags: tuple = (), decode_flags: tuple = ()):
        """`prefill_flags`/`decode_flags` go to one role only (e.g. its `--tp-size`)."""
        self.model = model
        self.flags = [*engine_flags, *FAST_FAILURE]
        self.prefill_flags, self.decode_flags = list(prefill_flags), list(decode_flags)
        self.bootstrap_port = free_port()
        self.prefill = self.start_prefill()
        self.decode = self.start_decode()
        self.router = Proc(
            [
                "router",
                "--port",
                str(free_port()),
                "--served-model-name",
                "tiny",
                "--prefill",
                self.prefill.url,
                str(self.bootstrap_port),
                "--decode",
                self.decode.url,
                "--health-interval",
                "0.5",
            ],
            0,
        )
        self.router.port = int(self.router.proc.args[3])
        self.router.url = f"http://127.0.0.1:{self.router.port}"

    def start_prefill(self, port: int | None = None) -> Proc:
        port = port or free_port()
        return Proc(
            [
                "prefill",
                "--model",
                self.model,
                "--port",
                str(port),
                "--bootstrap-port",
                str(self.bootstrap_port),
                *self.flags,
                *self.prefill_flags,
            ],
            port,
        )

    def start_decode(self, port: int | None = None) -> Proc:
        port = port or free_port()
        return Proc(["decode", "--model", self.model, "--port", str(port), *self.flags, *self.decode_flags], port)

    def wait_healthy(self) -> PDStack:
        self.prefill.wait_healthy()
        self.decode.wait_healthy()
        self.router.wait_healthy()
        return self

    def stop(self) -> None:
        for p in (self.router, self.decode, self.prefill):
            p.stop()
