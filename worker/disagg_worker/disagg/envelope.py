"""What a control frame's sealed body carries besides its message, so an authentic frame is acted on once.

A body is `Stamp` (packed below) followed by the encoded message (`messages.encode`); the channel seals the
whole body, so none of it can be altered without the model's key. The stamp says:

- `sender`: the sending channel's advertised control endpoint, host:port. The receiver cannot check it against
  anything (the frame arrives over a PULL socket that says nothing of its peer); it is only the key under which
  the receiver keeps that sender's state, and it is stable across the sender's restarts.
- `dest`: the endpoint the frame was sent to, so a frame captured on its way to one rank is not acted on by another
  rank of the model that has not yet heard that sender's later frames.
- `epoch`: when the sending channel started, wall-clock nanoseconds, so a restarted sender's frames are newer than
  all of its previous life's.
- `counter`: the sender's frame count, taken under its send lock, so strictly increasing per sender. It is shared
  by all the sender's peers and a forgotten socket loses the frames it held, so a receiver sees gaps; only order
  matters.

`Freshness` is the receiver's table: per sender, the highest (epoch, counter) it has acted on. A frame not above
it is a replay: the sender's own frames to one peer cannot arrive out of order, since it numbers and sends them
under one lock into one PUSH socket per peer, which delivers in order.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass

from disagg_worker.disagg.messages import CodecError

# epoch, counter, then the byte lengths of sender and dest (each at most MAX_ENDPOINT_BYTES)
_HEAD = struct.Struct(">QQHH")
MAX_ENDPOINT_BYTES = 512
# Senders remembered per receiver: a model has at most a few hundred ranks; only authentic frames (sealed with the
# model's key) reach the table, so a flood of invented senders can come only from a key holder, and is bounded.
MAX_SENDERS = 4096


@dataclass(frozen=True)
class Stamp:
    sender: str
    dest: str
    epoch: int
    counter: int

    @property
    def order(self) -> tuple[int, int]:
        """A newer epoch outranks any counter of an older one: a restarted sender starts counting afresh."""
        return self.epoch, self.counter


def stamp(s: Stamp, payload: bytes) -> bytes:
    sender, dest = s.sender.encode(), s.dest.encode()
    if len(sender) > MAX_ENDPOINT_BYTES or len(dest) > MAX_ENDPOINT_BYTES:
        raise ValueError(f"endpoint longer than {MAX_ENDPOINT_BYTES} bytes: {s.sender!r} -> {s.dest!r}")
    return _HEAD.pack(s.epoch, s.counter, len(sender), len(dest)) + sender + dest + payload


def unstamp(body: bytes) -> tuple[Stamp, bytes]:
    """The stamp and the message bytes of a body; raises CodecError when it does not start with a stamp."""
    if len(body) < _HEAD.size:
        raise CodecError(f"{len(body)} bytes: shorter than a stamp")
    epoch, counter, n_sender, n_dest = _HEAD.unpack_from(body)
    if n_sender > MAX_ENDPOINT_BYTES or n_dest > MAX_ENDPOINT_BYTES:
        raise CodecError("stamp endpoint too long")
    start = _HEAD.size
    end = start + n_sender + n_dest
    if len(body) < end:
        raise CodecError("stamp cut short")
    try:
        sender = body[start : start + n_sender].decode()
        dest = body[start + n_sender : end].decode()
    except UnicodeDecodeError as e:
        raise CodecError(f"stamp endpoint not UTF-8: {e}") from None
    return Stamp(sender, dest, epoch, counter), body[end:]


class Freshness:
    """Per sender, the highest (epoch, counter) acted on; the least recently heard sender is forgotten first.

    A forgotten sender's old frames would be taken once more, which takes a key holder inventing MAX_SENDERS
    senders first (and a key holder can seal any frame anyway). One thread only (the channel's receiver)."""

    def __init__(self, max_senders: int = MAX_SENDERS):
        self._max = max_senders
        self._seen: OrderedDict[str, tuple[int, int]] = OrderedDict()

    def admit(self, s: Stamp) -> bool:
        """Whether `s` is newer than all its sender's frames before it; if so, it becomes the one to beat."""
        last = self._seen.get(s.sender)
        if last is not None and s.order <= last:
            return False
        self._seen[s.sender] = s.order
        self._seen.move_to_end(s.sender)
        if len(self._seen) > self._max:
            self._seen.popitem(last=False)
        return True

    def __len__(self) -> int:
        return len(self._seen)
