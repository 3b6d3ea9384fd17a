"""A real Mooncake Store for tests: its master (with its HTTP metadata service) and one store server that holds
the store's memory, as the operator runs them in the store's pod."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.integration.procs import free_port
from tests.timing import wait_until

BIN = Path(sys.executable).parent


class KVStore:
    def __init__(self, memory: str = "256 MB"):
        self.memory = memory
        self.rpc, self.http, self.metrics, self.client_port = (free_port() for _ in range(4))
        self.window = 17300 + (os.getpid() % 100) * 8  # the store server's transfer-engine ports
        self.logs = Path(tempfile.mkdtemp(prefix="kvstore-"))
        self.master: subprocess.Popen | None = None
        self.server: subprocess.Popen | None = None
        self.started: list[subprocess.Popen] = []  # every process started, each stopped at the end
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http}/metadata"

    def flags(self) -> tuple[str, ...]:
        """The worker flags that put this store under an instance's host tier."""
        return (
            "--hicache-storage-backend",
            "mooncake",
            "--hicache-store-master",
            self.address,
            "--hicache-store-metadata-server",
            self.metadata,
        )

    def start(self) -> KVStore:
        """Start the master and the store server, each unless it runs; return once the store takes writes."""
        if not running(self.master):
            self.master = self._run(
                "master",
                [
                    str(BIN / "mooncake_master"),
                    "-rpc_port",
                    str(self.rpc),
                    "-enable_http_metadata_server=true",
                    "-http_metadata_server_host",
                    "127.0.0.1",
                    "-http_metadata_server_port",
                    str(self.http),
                    "-metrics_port",
                    str(self.metrics),
                ],
                {},
            )
        wait_until(lambda: listening(self.rpc) and listening(self.http), 30, interval=0.1, what="the store's master")
        self.server = self._run(
            "server",
            [
                str(BIN / "mooncake_client"),
                "-global_segment_size",
                self.memory,
                "-master_server_address",
                self.address,
                "-metadata_server",
                self.metadata,
                "-host",
                "127.0.0.1",
                "-port",
                str(self.client_port),
                "-protocol",
                "tcp",
            ],
            {"MC_MIN_RPC_PORT": str(self.window), "MC_MAX_RPC_PORT": str(self.window + 7)},
        )
        wait_until(self.writable, 60, interval=0.5, what="Mooncake Store taking writes")
        return self

    def _run(self, name: str, args: list[str], env: dict) -> subprocess.Popen:
        out = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - the process writes to it until it ends
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
        self.started.append(proc)
        return proc

    def writable(self) -> bool:
        """A client of the store can write and read a page (the server's memory is mounted)."""
        try:
            probe = subprocess.run(
                [sys.executable, "-c", PROBE, self.metadata, self.address], capture_output=True, timeout=20, check=False
            )
        except subprocess.TimeoutExpired:  # a client's set-up waits long for a master that is gone
            return False
        return probe.returncode == 0

    def kill_master(self) -> None:
        assert self.master is not None
        self.master.send_signal(signal.SIGKILL)
        self.master.wait(10)

    def stop(self) -> None:
        for p in self.started:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(10)


def running(p: subprocess.Popen | None) -> bool:
    return p is not None and p.poll() is None


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


PROBE = """
import sys
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
if s.setup("127.0.0.1", sys.argv[1], 0, 16 << 20, "tcp", "", sys.argv[2]) != 0:
    sys.exit(1)
ok = s.put("probe", b"x" * 4096) == 0 and len(s.get("probe")) == 4096
s.close()
sys.exit(0 if ok else 1)
"""
