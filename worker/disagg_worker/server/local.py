"""`disagg serve --local`: router + one prefill + one decode instance as separate local processes.

The same command lines a cluster runs, on 127.0.0.1 with Mooncake over TCP, with a shared secret
made for this run (a private file, removed at the end) as the operator makes one per model: the
router authenticates itself to the workers and signs the bootstrap targets it names. API keys
given to `serve --local` go to the router, the one endpoint clients see, and so do flow control's
flags (`--flow-control`, `--flow-*`: docs/flow-control.md). Ctrl-C (or SIGTERM) stops every process;
if any of them dies, the others are stopped too.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import requests

from disagg_api import router_settings as R

DISAGG = [sys.executable, "-m", "disagg_worker.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Flags that belong to the router, with a value: the clients' API keys and flow control's settings.
ROUTER_ONLY = ("--api-key", "--api-key-file", *(s.flag for s in R.FLOW if not s.switch))
# ... and without a value.
ROUTER_SWITCHES = tuple(s.flag for s in R.FLOW if s.switch)
# ... and those every process takes (with a value): one trace spans all three.
EVERY_PROCESS = ("--otlp-traces-endpoint", "--otlp-traces-sampling-ratio")
# Flags this launcher sets per process (with a value): the ports, and each role's ranks.
LAUNCHER = (
    "--port",
    "--host",
    "--dp-size",
    *(f"--{role}-{kind}-size" for role in ("prefill", "decode") for kind in ("tp", "pp", "ep", "dp")),
)
# ... and without a value.
LAUNCHER_SWITCHES = ("--enable-dp-attention", "--prefill-enable-dp-attention", "--decode-enable-dp-attention")


def split_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """The user's flags as (engine flags, router flags), minus the ones this launcher sets."""
    engine: list[str] = []
    router: list[str] = []
    it = iter(argv)
    for a in it:
        name = a.split("=", 1)[0]
        if a == "--local" or name in LAUNCHER_SWITCHES:
            continue
        if name in ROUTER_SWITCHES:
            router.append(a)
            continue
        if name in LAUNCHER or name in ROUTER_ONLY or name in EVERY_PROCESS:
            value = [] if "=" in a else [next(it, "")]
            if name in ROUTER_ONLY or name in EVERY_PROCESS:
                router += [a, *value]
            if name in EVERY_PROCESS:
                engine += [a, *value]
            continue
        engine.append(a)
    return engine, router


@dataclass(frozen=True)
class RoleRanks:
    """Tensor, pipeline and expert parallel sizes of the local prefill and decode instances, and their
    attention groups (DP attention)."""

    prefill_tp: int = 1
    prefill_pp: int = 1
    decode_tp: int = 1
    decode_pp: int = 1
    prefill_ep: int = 1
    decode_ep: int = 1
    prefill_dp: int = 1
    decode_dp: int = 1
    prefill_dp_attention: bool = False
    decode_dp_attention: bool = False

    def flags(self, role: str) -> list[str]:
        """The rank flags of `role`'s instance."""
        tp, pp, ep, dp, dp_attention = (getattr(self, f"{role}_{k}") for k in ("tp", "pp", "ep", "dp", "dp_attention"))
        out = ["--tp-size", str(tp), "--pp-size", str(pp), "--ep-size", str(ep), "--dp-size", str(dp)]
        return out + (["--enable-dp-attention"] if dp_attention else [])


def plan(
    argv: list[str], port: int, model_name: str, ranks: RoleRanks = RoleRanks(), secret_file: str = ""
) -> dict[str, list[str]]:
    flags, router_flags = split_flags(argv)
    auth = ["--auth-token-file", secret_file] if secret_file else []
    p_port, d_port, boot = free_port(), free_port(), free_port()
    p_ranks, d_ranks = ranks.flags("prefill"), ranks.flags("decode")
    return {
        "prefill": [*DISAGG, "prefill", *flags, *p_ranks, *auth, "--port", str(p_port), "--bootstrap-port", str(boot)],
        "decode": [*DISAGG, "decode", *flags, *d_ranks, *auth, "--port", str(d_port)],
        "router": [
            *DISAGG,
            "router",
            "--port",
            str(port),
            "--served-model-name",
            model_name,
            "--prefill",
            f"http://127.0.0.1:{p_port}",
            str(boot),
            "--decode",
            f"http://127.0.0.1:{d_port}",
            *auth,
            *router_flags,
        ],
    }


def write_secret(directory: str) -> str:
    """A fresh shared secret in a file only this user can read; returns its path."""
    path = os.path.join(directory, "auth-token")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32))
    return path


def wait_healthy(url: str, procs: dict[str, subprocess.Popen], timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, p in procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with code {p.returncode}")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not become healthy")


def stop_all(procs: dict[str, subprocess.Popen]) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for p in procs.values():
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_local(argv: list[str], host: str, port: int, model_name: str, ranks: RoleRanks = RoleRanks()) -> int:
    with tempfile.TemporaryDirectory(prefix="disagg-local-") as private:
        return _run(plan(argv, port, model_name, ranks, write_secret(private)), port, model_name)


def _run(cmds: dict[str, list[str]], port: int, model_name: str) -> int:
    env = {**os.environ, "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "WARNING")}
    procs: dict[str, subprocess.Popen] = {}
    stopping = False

    def on_signal(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for name in ("prefill", "decode", "router"):
            procs[name] = subprocess.Popen(cmds[name], env=env, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, procs)
        print(
            f"disagg serving {model_name} at {url} (router -> prefill + decode, Mooncake TCP)\n"
            f"try: curl {url}/v1/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{model_name}", "prompt": "Once upon a time", "max_tokens": 16}}\'',
            flush=True,
        )
        while not stopping:
            dead = [n for n, p in procs.items() if p.poll() is not None]
            if dead:
                print(f"{', '.join(dead)} exited; stopping the others", file=sys.stderr)
                return 1
            time.sleep(0.5)
        return 0
    finally:
        stop_all(procs)
