"""Support for the operator's cluster tests and benchmark (no tests here).

`OperatorUnderTest` installs the chart, mints a token for the chart's ServiceAccount and runs the operator as a
local process with that identity, so the chart's RBAC is what the operator gets. Its API traffic goes through
`CountingProxy`, which forwards every request to the API server and counts it by verb: that is how "no writes
while idle" and "API calls per reconcile" are measured.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "disagg-operator"
EXAMPLES = REPO / "examples"
OPERATOR_NS = "disagg-system"
RELEASE = "disagg-operator"
WRITE_METHODS = ("POST", "PUT", "PATCH", "DELETE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float = 60, interval: float = 0.5, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def resource_of(path: str) -> str:
    """`statefulsets`, `disaggregatedmodels/status`, ... from an API path."""
    parts = path.strip("/").split("/")
    if "namespaces" in parts and len(parts) > parts.index("namespaces") + 2:
        rest = parts[parts.index("namespaces") + 2 :]
        return rest[0] + ("/" + rest[2] if len(rest) > 2 else "")
    return parts[-1]


class CountingProxy:
    """A plain-HTTP reverse proxy on 127.0.0.1 in front of the API server, streaming (watches included)."""

    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self.port = free_port()
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        # Writes to these resources beyond the first `_hold_after` wait (`hold_child_writes`).
        self._hold_kinds: frozenset[str] = frozenset()
        self._hold_after = 0
        self._held = 0
        self._release: asyncio.Event | None = None
        threading.Thread(target=self._serve, daemon=True).start()
        self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def writes(self) -> int:
        with self._lock:
            return sum(n for (method, _), n in self.calls.items() if method in WRITE_METHODS)

    def hold_writes(self, kinds: frozenset[str], after: int) -> None:
        """From now on, let `after` writes to `kinds` through, then hold the rest: they wait, unanswered."""
        with self._lock:
            self._hold_kinds, self._hold_after, self._held = kinds, after, 0
        self._release = asyncio.Event()

    def held(self) -> int:
        """Writes to the held kinds seen since `hold_writes` (let through or waiting)."""
        with self._lock:
            return self._held

    def drop_held(self) -> None:
        """Answer every held write 503 without passing it on, and hold nothing more."""
        with self._lock:
            self._hold_kinds = frozenset()
        if self._release is not None:
            self._loop.call_soon_threadsafe(self._release.set)

    def snapshot(self) -> collections.Counter:
        with self._lock:
            return collections.Counter(self.calls)

    def _serve(self) -> None:
        from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

        async def handle(request: web.Request) -> web.StreamResponse:
            kind = resource_of(request.path) if request.method in WRITE_METHODS else "read"
            with self._lock:
                self.calls[(request.method, kind)] += 1
                hold = kind in self._hold_kinds and self._held >= self._hold_after
                if kind in self._hold_kinds:
                    self._held += 1
            if hold and self._release is not None:
                await self._release.wait()
                return web.Response(status=503, text="held by the test proxy")
            headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
            body = await request.read() if request.can_read_body else None
            async with self._session.request(
                request.method, self.upstream + request.path_qs, headers=headers, data=body or None
            ) as up:
                resp = web.StreamResponse(
                    status=up.status,
                    headers={
                        k: v
                        for k, v in up.headers.items()
                        if k.lower() not in ("content-length", "transfer-encoding", "connection")
                    },
                )
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp

        async def start() -> None:
            ctx = ssl.create_default_context()
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # a local test API server
            self._session = ClientSession(
                connector=TCPConnector(ssl=ctx, limit=0), auto_decompress=False, timeout=ClientTimeout(total=None)
            )
            app = web.Application(client_max_size=64 * 1024 * 1024)
            app.router.add_route("*", "/{tail:.*}", handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self._ready.set()

        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(start())
        self._loop.run_forever()


def install_chart(cluster, *extra: str) -> None:
    """`helm upgrade --install` the chart (idempotent across test modules and benchmark runs). Helm installs CRDs
    only on first install: they are also applied, as the README says to after an upgrade, for a reused cluster."""
    cluster.helm("upgrade", "--install", RELEASE, str(CHART), "--namespace", OPERATOR_NS, "--create-namespace", *extra)
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    for crd in ("disaggregatedmodels.disagg.dev", "rolescalers.disagg.dev"):
        cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{crd}")


def service_account_kubeconfig(cluster, server: str, path: Path) -> Path:
    token = cluster.kubectl("-n", OPERATOR_NS, "create", "token", RELEASE, "--duration=4h").stdout.strip()
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "sa",
                "clusters": [{"name": "local", "cluster": {"server": server}}],
                "users": [{"name": "sa", "user": {"token": token}}],
                "contexts": [{"name": "sa", "context": {"cluster": "local", "user": "sa"}}],
            }
        )
    )
    return path


def upstream_server(cluster) -> str:
    cfg = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    return cfg["clusters"][0]["cluster"]["server"]


class OperatorUnderTest:
    """`disagg-operator` as a local process with the chart's ServiceAccount identity, behind a CountingProxy."""

    def __init__(self, cluster, workdir: Path, args: tuple[str, ...] = ("--all-namespaces", "--standalone")):
        self.cluster = cluster
        self.workdir = workdir
        self.args = args
        self.proxy = CountingProxy(upstream_server(cluster))
        self.kubeconfig = service_account_kubeconfig(cluster, self.proxy.url, workdir / "sa-kubeconfig")
        self.log_path = workdir / "operator.log"
        self.proc: subprocess.Popen | None = None
        self.health_port = 0

    def start(self) -> None:
        self.health_port = free_port()
        exe = Path(sys.executable).parent / "disagg-operator"
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [str(exe), *self.args, f"--liveness=http://127.0.0.1:{self.health_port}/healthz"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        wait_until(self._healthy, 60, what=f"operator liveness (log: {self.log_path})")

    def _healthy(self) -> bool:
        assert self.proc and self.proc.poll() is None, self.log_path.read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: no graceful shutdown, whatever it was doing is cut off."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text()[-chars:] if self.log_path.exists() else ""


def load_example(example: str, **metadata) -> dict:
    cr = yaml.safe_load((EXAMPLES / example).read_text())
    cr["metadata"].update(metadata)
    return cr


def apply_cr(cluster, namespace: str, cr: dict, check: bool = True):
    return cluster.kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(cr), check=check)


def condition(cluster, namespace: str, name: str, ctype: str) -> dict:
    obj = cluster.get("-n", namespace, "dm", name)
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == ctype), {})


def events_for(cluster, namespace: str, name: str) -> list[dict]:
    items = cluster.get(
        "-n",
        namespace,
        "events",
        "--field-selector",
        f"involvedObject.kind=DisaggregatedModel,involvedObject.name={name}",
    )["items"]
    return items
