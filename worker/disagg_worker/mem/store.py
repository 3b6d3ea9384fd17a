"""Mooncake Store as the KV tier under host memory (L3): one client per instance, shared by every instance of a model.

The instance contributes no memory of its own (a segment of 0 bytes): the store's memory is its store servers'
(`mooncake_client` processes, the operator's store pod), so pages outlive the instance that wrote them. A page is
kept under `<prefix>/<name>`: the prefix says whose pages they are (the model, its KV layout, the key of its names),
the name which token prefix they hold (`kv_events.page_hash`, keyed with the model's secret). Each value carries a
keyed tag over its key and bytes (`mem/page_tag.py`): a page that fails it is dropped from the store and read as a
miss, so a page changed in the store (by a fault, or by anyone who reaches the store's unauthenticated master) is
computed again, never served.

Every call is blocking and may take seconds when the store is gone (Mooncake's own RPC timeouts), so only the tiers'
store threads (a reader and a writer) call these methods, never the scheduler; a lock makes their calls one at a
time, so that a client is never closed (after a failure) while the other thread uses it. A client that cannot set
up or whose calls fail is `down` for `RETRY_S`, then set up again: a store that restarts is used again without
restarting the instance.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from disagg_worker.mem.page_tag import PageSeal

log = logging.getLogger(__name__)

RETRY_S = 5.0  # how long a failed store is left alone before it is tried again
LOCAL_BUFFER = 64 << 20  # the client's registered buffer for puts and gets


def mooncake_client() -> Any:
    """A new client of Mooncake Store, not yet set up (what `MooncakeStore` makes unless handed another maker)."""
    from mooncake.store import MooncakeDistributedStore

    return MooncakeDistributedStore()


class MooncakeStore:
    def __init__(
        self,
        master: str,
        metadata_server: str,
        host: str,
        prefix: str,
        seal: PageSeal,
        new_client: Callable[[], Any] = mooncake_client,
    ):
        self.master = master
        self.metadata_server = metadata_server
        self.host = host
        self.prefix = prefix
        self.seal = seal
        self.new_client = new_client
        self._client: Any = None
        self._down_until = 0.0
        self._lock = threading.RLock()

    @property
    def up(self) -> bool:
        return self._client is not None

    def key(self, name: int) -> str:
        return f"{self.prefix}/{name:016x}"

    def _connect_unlocked(self) -> bool:
        if self._client is not None:
            return True
        if time.monotonic() < self._down_until:
            return False
        client = self.new_client()
        rc = client.setup(self.host, self.metadata_server, 0, LOCAL_BUFFER, "tcp", "", self.master)
        if rc != 0:
            self._fail(f"setting up the client failed (rc {rc})")
            return False
        self._client = client
        log.info("KV store: connected to Mooncake Store at %s", self.master)
        return True

    def _exists_unlocked(self, names: Sequence[int]) -> int:
        if not names or not self._connect_unlocked():
            return 0
        found = self._client.batch_is_exist([self.key(n) for n in names])
        n = 0
        for rc in found:
            if rc == 1:
                n += 1
                continue
            if rc < 0:  # not "absent" but a failed call
                self._fail(f"looking pages up failed (rc {rc})")
            break
        return n

    def _get_unlocked(self, names: Sequence[int]) -> list[bytes]:
        if not names or not self._connect_unlocked():
            return []
        keys = [self.key(n) for n in names]
        out = []
        for key, value in zip(keys, self._client.get_batch(keys), strict=False):
            if not value:
                break
            page = self.seal.open(key, bytes(value))
            if page is None:
                self._drop(key)
                break
            out.append(page)
        if len(out) < len(names):
            log.info("KV store: %d of %d pages read", len(out), len(names))
        return out

    def _put_unlocked(self, names: Sequence[int], values: Sequence[bytes]) -> bool:
        if not names or not self._connect_unlocked():
            return False
        keys = [self.key(n) for n in names]
        rc = self._client.put_batch(keys, [self.seal.seal(k, v) for k, v in zip(keys, values, strict=True)])
        if rc != 0:
            self._fail(f"writing {len(names)} pages failed (rc {rc})")
        return rc == 0

    def _drop(self, key: str) -> None:
        """Remove a page that failed its check, so that the page computed again can be written in its place (a put
        under a key the store holds keeps the old value). Forced: the read just made holds a lease on it."""
        rc = self._client.remove(key, True)
        if rc != 0:
            log.debug("KV store: removing %s failed (rc %d)", key, rc)

    def _fail(self, why: str) -> None:
        log.warning("KV store at %s: %s; computing instead, trying again in %.0f s", self.master, why, RETRY_S)
        self._down_until = time.monotonic() + RETRY_S
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - a broken client may fail to close too
                log.debug("closing the store client failed", exc_info=True)

    def _close_unlocked(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def connect(self) -> bool:
        """Set the client up if it is not (and not within `RETRY_S` of a failure); whether it is up."""
        with self._lock:
            return self._connect_unlocked()

    def exists(self, names: Sequence[int]) -> int:
        """How many of `names`, from the first, the store holds."""
        with self._lock:
            return self._exists_unlocked(names)

    def get(self, names: Sequence[int]) -> list[bytes]:
        """The pages named `names`, from the first, up to the first the store fails to give."""
        with self._lock:
            return self._get_unlocked(names)

    def put(self, names: Sequence[int], values: Sequence[bytes]) -> bool:
        with self._lock:
            return self._put_unlocked(names, values)

    def close(self) -> None:
        with self._lock:
            self._close_unlocked()
