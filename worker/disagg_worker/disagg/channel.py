"""zmq control channel: one PULL socket to receive, one PUSH socket per peer endpoint.

It carries the backend-neutral control messages (`messages`) and knows nothing of how the KV
bytes move, so a backend other than Mooncake would reuse it as it is.

`send` may be called from any thread (serialised by a lock); `recv` from one thread only.
Sends never block: a peer that is gone or not reading just loses the message, and the
timeouts on both sides turn that into a Failed room.
"""

from __future__ import annotations

import logging
import threading

import zmq

from disagg_worker.disagg.messages import CodecError, Message, decode, encode

log = logging.getLogger(__name__)


class ControlChannel:
    def __init__(self, bind_host: str, advertise_host: str):
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        port = self._pull.bind_to_random_port(f"tcp://{bind_host}")
        self.endpoint = f"tcp://{advertise_host}:{port}"
        self.port = port
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        self._lock = threading.Lock()
        self._push: dict[str, zmq.Socket] = {}

    def send(self, endpoint: str, msg: Message) -> bool:
        """Queue `msg` for `endpoint`; False if it was dropped (peer queue full)."""
        frame = encode(msg)
        with self._lock:
            sock = self._push.get(endpoint)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 10000)
                sock.connect(endpoint)
                self._push[endpoint] = sock
            try:
                sock.send(frame, zmq.NOBLOCK)
                return True
            except zmq.Again:
                log.warning("control message to %s dropped: peer not reading", endpoint)
                return False

    def recv(self, timeout_ms: int) -> list[Message]:
        """Messages that arrive within `timeout_ms` (all queued ones); malformed frames are
        logged and dropped."""
        out: list[Message] = []
        if not self._poller.poll(timeout_ms):
            return out
        while True:
            try:
                frame = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                out.append(decode(frame))
            except CodecError as e:
                log.warning("dropped malformed control frame: %s", e)

    def close(self) -> None:
        with self._lock:
            for sock in self._push.values():
                sock.close(0)
            self._push.clear()
        self._pull.close(0)
        self._ctx.term()
