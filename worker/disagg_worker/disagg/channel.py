"""zmq control channel: one PULL socket to receive, one PUSH socket per peer endpoint.

It carries the backend-neutral control messages (`messages`) and knows nothing of how the KV
bytes move, so a backend other than Mooncake would reuse it as it is.

`send` may be called from any thread (serialised by a lock); `recv` from one thread only.
Sends never block: a peer that is gone or not reading just loses the message, and the
timeouts on both sides turn that into a Failed room. `forget(endpoint)` closes the socket to a
peer that is gone (a later send opens a new one).

The PULL socket listens on a configured port (`DisaggConfig.control_port_of`, what the
operator's NetworkPolicy opens) or, with port 0, on any free port (local runs). It binds the
advertised address when that is an IP address, else every interface.

Whoever reaches the port is not trusted: every frame carries an HMAC-SHA256 of its body under a key
derived from the model's secret (`keys.control_key`), and is at most MAX_FRAME_BYTES. A frame that fails
either check, or does not decode, is dropped and counted (`disagg_kv_control_frames_rejected_total`), never
acted on. zmq itself drops a peer that sends a frame beyond ZMQ_MAX_FRAME_BYTES before it is held.

Nor is an authentic frame acted on twice: its sealed body starts with a stamp (`envelope`) naming its
sender (that channel's endpoint), the endpoint it was sent to, the sender channel's start (epoch) and a
per-sender counter. The receiver keeps, per sender, the highest (epoch, counter) it has acted on and drops
a frame not above it (reason "replayed") or addressed to another endpoint ("misaddressed"), so a frame
captured off the network and sent again, to this rank or another, changes nothing. What it does not cover:
a receiver that restarts forgets its table, so it acts once on a frame captured before, until it hears that
sender again. Such a frame names rooms of the previous process, which the new one does not have (a request,
update or abort for a room it does not know expires or is ignored); a replayed DecodeHello describes the
decode rank as it was then, and stands only until that rank's own next hello (decode greets each prefill
instance it resolves, so a restarted one, before sending it requests, and again after a silence). A sender whose
clock steps back across its restart is not heard by a receiver that remembers its last life until its epoch
passes that one again. Frames are sealed, not encrypted: anyone on the path can read them.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import threading
import time

import zmq
from prometheus_client import Counter

from disagg_worker.disagg.envelope import Freshness, Stamp, stamp, unstamp
from disagg_worker.disagg.messages import CodecError, Message, decode, encode

log = logging.getLogger(__name__)

# The largest control frame: a RoomRequest's page list for a 1M-token prompt in pages of 16 tokens is ~0.5 MB.
MAX_FRAME_BYTES = 8 << 20
# zmq drops (and disconnects) a peer sending a frame beyond this before holding it; frames between the two limits
# are read and counted as oversized. At most RCVHWM frames per peer wait unread (legit bursts queue at the sender).
ZMQ_MAX_FRAME_BYTES = MAX_FRAME_BYTES + (1 << 20)
RCVHWM = 16
MAC_BYTES = 32
REJECTED = Counter(
    "disagg_kv_control_frames_rejected_total",
    "Control frames dropped unread: oversized, unauthenticated (a bad HMAC), malformed, replayed (acted on before)"
    " or misaddressed (sealed for another endpoint)",
    ["reason"],
)


def seal(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest() + body


def unseal(key: bytes, frame: bytes) -> bytes | None:
    """The body of an authentic frame; None when its MAC does not match."""
    mac, body = frame[:MAC_BYTES], frame[MAC_BYTES:]
    return body if hmac.compare_digest(mac, hmac.new(key, body, hashlib.sha256).digest()) else None


def is_loopback(host: str) -> bool:
    """An IP address of the loopback interface (a host name is not: it may resolve anywhere)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_host(advertise_host: str) -> str:
    """The address to listen on: the advertised one when it is an IP address, else all of them."""
    try:
        ipaddress.ip_address(advertise_host)
    except ValueError:
        return "0.0.0.0"
    return advertise_host


class ControlChannel:
    def __init__(self, advertise_host: str, port: int = 0, key: bytes = b""):
        """`key`: the frames' HMAC key (`keys.control_key`), the same on every rank of the model."""
        self._key = key
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, ZMQ_MAX_FRAME_BYTES)
        self._pull.setsockopt(zmq.RCVHWM, RCVHWM)
        host = bind_host(advertise_host)
        if port:
            try:
                self._pull.bind(f"tcp://{host}:{port}")
            except zmq.ZMQError as e:
                self._pull.close(0)
                self._ctx.term()
                raise RuntimeError(f"control channel cannot listen on {host}:{port}: {e}") from None
        else:
            port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{advertise_host}:{port}"
        self.port = port
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        self._lock = threading.Lock()
        self._push: dict[str, zmq.Socket] = {}
        self._epoch = time.time_ns()  # wall clock, so a restarted channel's frames are newer than its last life's
        self._sent = 0  # frames stamped, under _lock
        self._heard = Freshness()  # recv's thread only

    def send(self, endpoint: str, msg: Message) -> bool:
        """Queue `msg` for `endpoint`; False if it was dropped (peer queue full)."""
        payload = encode(msg)
        with self._lock:
            # Numbered and sent under one lock: a peer receives this sender's frames in counter order, so a
            # receiver drops nothing honest as replayed.
            self._sent += 1
            frame = seal(self._key, stamp(Stamp(self.endpoint, endpoint, self._epoch, self._sent), payload))
            sock = self._push.get(endpoint)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 10000)
                try:
                    sock.connect(endpoint)
                except zmq.ZMQError:
                    sock.close(0)
                    raise
                self._push[endpoint] = sock
            try:
                sock.send(frame, zmq.NOBLOCK)
                return True
            except zmq.Again:
                log.warning("control message to %s dropped: peer not reading", endpoint)
                return False

    def forget(self, endpoint: str) -> None:
        """Close the socket to `endpoint` (a peer that is gone); queued messages are dropped."""
        with self._lock:
            sock = self._push.pop(endpoint, None)
        if sock is not None:
            sock.close(0)

    @property
    def peers(self) -> int:
        """Endpoints with an open socket."""
        with self._lock:
            return len(self._push)

    def recv(self, timeout_ms: int) -> list[Message]:
        """Authentic messages that arrive within `timeout_ms` (all queued ones); any other frame is
        counted and dropped."""
        out: list[Message] = []
        if not self._poller.poll(timeout_ms):
            return out
        while True:
            try:
                frame = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            m = self._open(frame)
            if m is not None:
                out.append(m)

    def _open(self, frame: bytes) -> Message | None:
        if len(frame) > MAX_FRAME_BYTES + MAC_BYTES:
            _reject("oversized", f"{len(frame)} bytes")
            return None
        body = unseal(self._key, frame)
        if body is None:
            _reject("unauthenticated", "its HMAC does not match this model's key")
            return None
        try:
            stamped, payload = unstamp(body)
            if stamped.dest != self.endpoint:
                _reject("misaddressed", f"from {stamped.sender} for {stamped.dest}")
                return None
            if not self._heard.admit(stamped):
                _reject("replayed", f"from {stamped.sender}: epoch {stamped.epoch} frame {stamped.counter}")
                return None
            return decode(payload)
        except (CodecError, RecursionError, TypeError) as e:
            _reject("malformed", str(e)[:200])
            return None

    def close(self) -> None:
        with self._lock:
            for sock in self._push.values():
                sock.close(0)
            self._push.clear()
        self._pull.close(0)
        self._ctx.term()


def _reject(reason: str, detail: str) -> None:
    REJECTED.labels(reason).inc()
    log.warning("dropped a control frame (%s): %s", reason, detail)
