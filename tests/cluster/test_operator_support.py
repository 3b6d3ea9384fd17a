"""Support for the operator's cluster tests and benchmark (no tests here).

`OperatorUnderTest` installs the chart, mints a token for the chart's ServiceAccount and runs the operator as a
local process with that identity, so the chart's RBAC is what the operator gets. Its API traffic goes through
`CountingProxy`, which forwards every request to the API server and counts it by verb: that is how "no writes
while idle" and "API calls per reconcile" are measured. The proxy also records each write's namespace and every
watch event it passes to the operator, so a test can wait until the operator has been told of a change (and so
has had its chance to act on it) instead of sleeping.
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
import urllib.request
from pathlib import Path
from typing import NamedTuple

import yaml

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # the benchmark imports this module from outside pytest
    sys.path.insert(0, str(REPO))

from tests.timing import scaled, wait_until  # noqa: E402  (the tests and the benchmark import both from here)

CHART = REPO / "charts" / "disagg-operator"
EXAMPLES = REPO / "examples"
OPERATOR_NS = "disagg-system"
RELEASE = "disagg-operator"
WRITE_METHODS = ("POST", "PUT", "PATCH", "DELETE")
POLL_S = 0.5  # between polls that run kubectl: each starts a process, which a loaded 2-core machine feels


def kube_timeout(seconds: float) -> str:
    """A kubectl or helm `--timeout` of `seconds` on a quiet machine, stretched like every deadline."""
    return f"{scaled(seconds):.0f}s"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resource_of(path: str) -> str:
    """`statefulsets`, `disaggregatedmodels/status`, ... from an API path."""
    parts = path.strip("/").split("/")
    if "namespaces" in parts and len(parts) > parts.index("namespaces") + 2:
        rest = parts[parts.index("namespaces") + 2 :]
        return rest[0] + ("/" + rest[2] if len(rest) > 2 else "")
    return parts[-1]


def namespace_of(path: str) -> str | None:
    parts = path.strip("/").split("/")
    if "namespaces" in parts and len(parts) > parts.index("namespaces") + 2:
        return parts[parts.index("namespaces") + 1]
    return None


class WatchEvent(NamedTuple):
    """One event of a watch stream the proxy passed on to the operator."""

    type: str
    kind: str
    namespace: str | None
    name: str
    resource_version: str


class Write(NamedTuple):
    method: str
    kind: str  # as `resource_of` names it
    namespace: str | None
    path: str


class CountingProxy:
    """A plain-HTTP reverse proxy on 127.0.0.1 in front of the API server, streaming (watches included)."""

    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self.port = free_port()
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()
        self._writes: list[Write] = []
        self._delivered: list[WatchEvent] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        # Writes to these resources in `_hold_namespace` beyond the first `_hold_after` wait (`hold_writes`).
        self._hold_kinds: frozenset[str] = frozenset()
        self._hold_namespace: str | None = None
        self._hold_after = 0
        self._held = 0
        self._release: asyncio.Event | None = None
        threading.Thread(target=self._serve, daemon=True).start()
        if not self._ready.wait(scaled(10)):
            raise TimeoutError("the counting proxy did not start")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def writes(self) -> int:
        with self._lock:
            return sum(n for (method, _), n in self.calls.items() if method in WRITE_METHODS)

    def writes_in(self, namespace: str, since: int = 0) -> list[Write]:
        """The writes into `namespace`, from the `since`-th write of all (`write_mark`) on."""
        with self._lock:
            return [w for w in self._writes[since:] if w.namespace == namespace]

    def write_mark(self) -> int:
        """A mark for `writes_in`: the number of writes seen so far."""
        with self._lock:
            return len(self._writes)

    def delivered(self, type: str | None = None, namespace: str | None = None) -> list[WatchEvent]:
        """The watch events passed on to the operator so far, optionally of one type or namespace."""
        with self._lock:
            events = list(self._delivered)
        return [
            e for e in events if (type is None or e.type == type) and (namespace is None or e.namespace == namespace)
        ]

    def hold_writes(self, kinds: frozenset[str], after: int, namespace: str) -> None:
        """From now on, let `after` writes to `kinds` in `namespace` through, then hold the rest: they wait,
        unanswered. Writes elsewhere (a namespace of an earlier test being torn down) pass and are not counted."""
        with self._lock:
            self._hold_kinds, self._hold_namespace, self._hold_after, self._held = kinds, namespace, after, 0
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

    def _record_events(self, data: bytes) -> bytes:
        """Record the complete lines of a watch stream (one JSON event each); returns the incomplete rest."""
        *lines, rest = data.split(b"\n")
        events = []
        for line in lines:
            try:
                event = json.loads(line)
                obj, meta = event["object"], event["object"]["metadata"]
                events.append(
                    WatchEvent(event["type"], obj["kind"], meta.get("namespace"), meta["name"], meta["resourceVersion"])
                )
            except (ValueError, KeyError, TypeError):  # a bookmark or an error status: nothing to record
                continue
        with self._lock:
            self._delivered.extend(events)
        return rest

    def _serve(self) -> None:
        from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

        async def handle(request: web.Request) -> web.StreamResponse:
            write = request.method in WRITE_METHODS
            kind = resource_of(request.path) if write else "read"
            namespace = namespace_of(request.path)
            watching = request.method == "GET" and request.query.get("watch") in ("true", "1")
            with self._lock:
                self.calls[(request.method, kind)] += 1
                if write:
                    self._writes.append(Write(request.method, kind, namespace, request.path))
                counted = kind in self._hold_kinds and namespace == self._hold_namespace
                hold = counted and self._held >= self._hold_after
                if counted:
                    self._held += 1
            if hold and self._release is not None:
                await self._release.wait()
                return web.Response(status=503, text="held by the test proxy")
            skip = ("host", "content-length") + (("accept-encoding",) if watching else ())  # events read as sent
            headers = {k: v for k, v in request.headers.items() if k.lower() not in skip}
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
                pending = b""
                async for chunk in up.content.iter_any():
                    if watching and up.status == 200:  # recorded before the operator can have read it
                        pending = self._record_events(pending + chunk)
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
    only on first install: they are also applied, as operator/README-operator.md says to after an upgrade, for a
    reused cluster."""
    cluster.helm("upgrade", "--install", RELEASE, str(CHART), "--namespace", OPERATOR_NS, "--create-namespace", *extra)
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds"))
    for crd in ("disaggregatedmodels.disagg.dev", "rolescalers.disagg.dev"):
        cluster.kubectl("wait", "--for=condition=Established", f"--timeout={kube_timeout(60)}", f"crd/{crd}")


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
        wait_until(self._healthy, 60, POLL_S, what=f"operator liveness (log: {self.log_path})")

    def _healthy(self) -> bool:
        assert self.proc and self.proc.poll() is None, self.log_path.read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=scaled(2)) as r:
                return r.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: no graceful shutdown, whatever it was doing is cut off."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(scaled(30))

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(scaled(30))
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
    """The Events about a DisaggregatedModel, oldest first (by eventTime: the operator stamps it in microseconds;
    the API server lists Events by name, which is random)."""
    items = cluster.get(
        "-n",
        namespace,
        "events",
        "--field-selector",
        f"involvedObject.kind=DisaggregatedModel,involvedObject.name={name}",
    )["items"]
    return sorted(items, key=lambda e: e.get("eventTime") or e.get("lastTimestamp") or "")
