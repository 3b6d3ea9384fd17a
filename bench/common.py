"""What the benchmarks share: the machine they ran on, a free port, and `disagg serve` as a child process."""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Self

DISAGG = str(Path(sys.executable).with_name("disagg"))
RESULTS = Path(__file__).resolve().parent / "results"
LATENCY_KEYS = tuple(f"p{q}_{m}_ms" for m in ("ttft", "itl", "e2e") for q in (50, 90, 99))


def machine_info(**extra: str) -> dict:
    """CPU, cores, memory, kernel, library versions and the load average when the run started."""
    import torch

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    mem_kb = int(
        next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal"))
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kb / 2**20, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        **extra,
        "load_average_at_start": list(os.getloadavg()),
    }


def bench_args(
    url: str, *, num_prompts: int, concurrency: int, input_len: int, output_len: int, seed: int = 0
) -> argparse.Namespace:
    """The arguments of `disagg bench serve` for one load (`seed` picks the random prompts)."""
    from disagg_worker.bench import serve as serve_bench

    p = argparse.ArgumentParser()
    serve_bench.add_args(p)
    return p.parse_args(
        [
            "--base-url",
            url,
            "--num-prompts",
            str(num_prompts),
            "--max-concurrency",
            str(concurrency),
            "--input-len",
            str(input_len),
            "--output-len",
            str(output_len),
            "--seed",
            str(seed),
        ]
    )


def pick(report: dict, *keys: str) -> dict:
    return {k: round(report[k], 3) for k in keys}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


class Serve:
    """`disagg serve MODEL FLAGS` in its own process group; `with Serve(...) as s:` starts it and waits for
    /health, or use start() / wait_healthy() / stop() to start several before waiting."""

    def __init__(self, model: str, *flags: str, env: dict[str, str] | None = None, name: str = "bench"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        fd, self.log = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
        os.close(fd)
        self.argv = [DISAGG, "serve", "--model", model, "--port", str(self.port), "--log-level", "warning", *flags]
        self.env = {**os.environ, "MC_LOG_LEVEL": "WARNING", **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self) -> Self:
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        return self

    def wait_healthy(self, timeout: float = 300) -> Self:
        if self.proc is None:
            raise RuntimeError("wait_healthy() before start()")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv} exited: {Path(self.log).read_text()[-3000:]}")
            try:
                if get_json(f"{self.url}/health").get("status") == "ok":
                    return self
            except (OSError, ValueError):
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{self.url} did not become healthy")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        Path(self.log).unlink(missing_ok=True)

    def __enter__(self) -> Self:
        return self.start().wait_healthy()

    def __exit__(self, *exc) -> None:
        self.stop()
