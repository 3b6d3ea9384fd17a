"""Keyed integrity tags on the pages kept in Mooncake Store (`mem/store.py`).

The store is shared by every instance of a model and its master asks no one who they are, so a page read back is
not trusted: each value in the store is the page's bytes followed by a tag, keyed BLAKE2b (`TAG_BYTES`) over the
page's store key (`<prefix>/<name>`) and its bytes, under a key derived from the model's secret
(`keys.store_tag_key`). A value whose length is not a page's plus a tag, or whose tag fails, is a miss: the store
drops it and the tokens it would have held are computed again, as on any miss. Covering the key binds a page to
its name: another name's page, authentic as it may be, fails here, so no prefix can be answered with another's KV.

Without a secret the key is a fixed one: the tag then catches corruption (a flipped bit, a truncated value, a page
written under another name), not forgery, since anyone can compute it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time

from prometheus_client import Counter

log = logging.getLogger(__name__)

TAG_BYTES = 16
LOG_EVERY_S = 60.0  # a flood of rejected pages is logged once per this long, with how many

REJECTED = Counter(
    "disagg_kv_store_pages_rejected",
    "Pages read from Mooncake Store and dropped (computed again instead): tag (its integrity tag failed: changed, "
    "forged, or another name's page), size (not the length of a page and its tag)",
    ["reason"],
)


class PageSeal:
    """Seals pages of `page_nbytes` bytes under `key` for the store, and opens what the store gives back."""

    def __init__(self, key: bytes, page_nbytes: int):
        self.key = key
        self.page_nbytes = page_nbytes
        self._unlogged = 0
        self._logged_at = -LOG_EVERY_S

    def tag(self, name: str, page: bytes | memoryview) -> bytes:
        h = hashlib.blake2b(key=self.key, digest_size=TAG_BYTES, person=b"disagg-kv-page")
        h.update(len(name).to_bytes(4, "big") + name.encode())
        h.update(page)
        return h.digest()

    def seal(self, name: str, page: bytes) -> bytes:
        """The value to store under `name`: the page, then its tag."""
        return page + self.tag(name, page)

    def open(self, name: str, value: bytes) -> bytes | None:
        """The page in `value` read under `name`, or None (counted, and logged now and then) if it is not one."""
        if len(value) != self.page_nbytes + TAG_BYTES:
            self._reject("size", name)
            return None
        view = memoryview(value)
        if not hmac.compare_digest(self.tag(name, view[: self.page_nbytes]), view[self.page_nbytes :]):
            self._reject("tag", name)
            return None
        return bytes(view[: self.page_nbytes])

    def _reject(self, reason: str, name: str) -> None:
        REJECTED.labels(reason).inc()
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY_S:
            log.warning(
                "KV store: dropped %d page(s) that failed their check (the last: %s, %s); computing them instead",
                self._unlogged,
                name,
                reason,
            )
            self._unlogged, self._logged_at = 0, now
