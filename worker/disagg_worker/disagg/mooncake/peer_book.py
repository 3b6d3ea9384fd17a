"""The decode ranks a prefill rank knows, and when it forgets one.

A decode rank introduces itself with a `DecodeHello` carrying its `decode_id`, which is new for each
decode process (an incarnation), its reply endpoint and its transfer session (`host:port`). Two things
end an incarnation here:
- Another incarnation says hello from the same reply endpoint or the same transfer session: the decode
  process restarted and reuses the address (control ports are configured per rank, and a restarted
  Mooncake engine may take its old port again). The old incarnation is gone: its rooms must fail at
  once, not wait for their timeouts, and nothing may be written to it any more.
- Silence: no message from it for `idle_s` while none of its rooms is live. Prefill then releases what
  it holds for the peer (its transfer thread and its control socket). Decode greets a rank again before
  a request whenever it sent that rank nothing for `TUNING.transfer.hello_refresh_s` (shorter than
  `idle_s`), so a peer that comes back is known again before its request arrives.
Only the control thread of the prefill manager calls this class.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg_worker.disagg.base import KVLayout
from disagg_worker.disagg.messages import DecodeHello
from disagg_worker.disagg.mooncake.peers import DecodePeer


@dataclass
class KnownPeer:
    decode_id: str
    endpoint: str  # where its room updates go
    peer: DecodePeer
    last_seen: float


class PeerBook:
    def __init__(self) -> None:
        self._known: dict[str, KnownPeer] = {}

    def __len__(self) -> int:
        return len(self._known)

    def get(self, decode_id: str) -> DecodePeer | None:
        known = self._known.get(decode_id)
        return known.peer if known else None

    def hello(self, msg: DecodeHello, local: KVLayout, now: float) -> list[KnownPeer]:
        """Record `msg`'s incarnation; returns the earlier incarnations it replaces (same endpoint or
        session, another decode id), which are forgotten."""
        replaced = [
            k
            for k in self._known.values()
            if k.decode_id != msg.decode_id
            and (k.endpoint == msg.reply_endpoint or k.peer.session_id == msg.session_id)
        ]
        for k in replaced:
            del self._known[k.decode_id]
        self._known[msg.decode_id] = KnownPeer(
            msg.decode_id, msg.reply_endpoint, DecodePeer.from_hello(msg, local), now
        )
        return replaced

    def known(self) -> list[KnownPeer]:
        return list(self._known.values())

    def seen(self, decode_id: str, now: float) -> None:
        known = self._known.get(decode_id)
        if known is not None:
            known.last_seen = now

    def idle(self, now: float, idle_s: float, busy: set[str]) -> list[KnownPeer]:
        """Forget and return the peers silent for longer than `idle_s` whose decode id is not in `busy`."""
        gone = [k for k in self._known.values() if now - k.last_seen > idle_s and k.decode_id not in busy]
        for k in gone:
            del self._known[k.decode_id]
        return gone

    def uses(self, endpoint: str = "", session_id: str = "") -> bool:
        """Whether a known peer still uses this reply endpoint or transfer session."""
        return any(k.endpoint == endpoint or k.peer.session_id == session_id for k in self._known.values())
