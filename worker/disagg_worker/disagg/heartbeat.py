"""Decode-side liveness check of prefill instances: `GET /health` of each bootstrap server.

After `max_misses` consecutive failed checks, or when the server reports another instance
id (the instance restarted), `on_lost(addr, reason, dead)` is called once and the address is
no longer watched. `dead` is True when the old instance is known to write nothing more: it
restarted, or its port refuses connections; a silent (frozen) instance is not known dead.
A silent instance stays on probation: `on_dead(addr)` is called if it later refuses or comes
back with another instance id, so pages held for it are not quarantined forever; if it comes
back as the same instance, probation ends (its own late updates settle those pages).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from disagg_worker.disagg.bootstrap_client import REFUSED, check_health
from disagg_worker.tuning import TUNING

OnLost = Callable[[str, str, bool], None]


class HeartbeatMonitor:
    def __init__(
        self,
        interval_s: float,
        max_misses: int,
        on_lost: OnLost,
        on_dead: Callable[[str], None] | None = None,
        check=check_health,
    ):
        self._interval = interval_s
        self._on_dead = on_dead
        self._silent: dict[str, str] = {}  # addr -> instance id of a lost, not known dead, instance
        self._max_misses = max(1, max_misses)
        self._on_lost = on_lost
        self._check = check
        self._lock = threading.Lock()
        self._watched: dict[str, tuple[str, int]] = {}  # addr -> (instance id, misses)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-heartbeat", daemon=True)
        self._thread.start()

    def watch(self, addr: str, instance_id: str) -> None:
        with self._lock:
            self._watched[addr] = (instance_id, 0)

    def unwatch(self, addr: str) -> None:
        with self._lock:
            self._watched.pop(addr, None)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            with self._lock:
                targets = list(self._watched.items())
                silent = list(self._silent.items())
            timeout = min(self._interval, TUNING.transfer.heartbeat_timeout_s)
            for addr, (instance_id, _) in targets:
                self._beat(addr, instance_id, self._check(addr, timeout))
            for addr, instance_id in silent:
                self._probe(addr, instance_id, self._check(addr, timeout))

    def _probe(self, addr: str, instance_id: str, seen: str | None) -> None:
        if seen is None:
            return
        with self._lock:
            self._silent.pop(addr, None)
        if self._on_dead is not None and (seen == REFUSED or seen != instance_id):
            self._on_dead(addr)

    def _beat(self, addr: str, instance_id: str, seen: str | None) -> None:
        refused = seen == REFUSED
        answered = seen is not None and not refused
        with self._lock:
            if addr not in self._watched:
                return
            misses = 0 if answered else self._watched[addr][1] + 1
            lost = misses >= self._max_misses or (answered and seen != instance_id)
            if lost:
                del self._watched[addr]
            else:
                self._watched[addr] = (instance_id, misses)
        if not lost:
            return
        if answered:
            self._on_lost(addr, f"prefill instance {addr} restarted (instance id changed)", True)
        elif refused:  # nothing listens any more: the instance is gone and writes nothing
            self._on_lost(addr, f"prefill instance {addr} is gone (connection refused)", True)
        else:
            if self._on_dead is not None:
                with self._lock:
                    self._silent[addr] = instance_id
            self._on_lost(addr, f"prefill instance {addr} lost: {misses} heartbeats missed", False)
