"""The other attention groups' drivers under DP attention, and how one wakes them.

With DP attention every attention group's driver schedules its own requests, but the groups step together
(`group.RankGroup.start`): a driver with work wakes the others, which may be asleep on their inboxes until
their next report is due.
"""

from __future__ import annotations

import zmq

from disagg_worker.request import messages as msg


class Peers:
    """PUSH sockets to the other drivers' inboxes (none without DP attention)."""

    def __init__(self, inboxes: list[str]):
        self.ctx = zmq.Context()
        self.sockets = []
        for addr in inboxes:
            peer = self.ctx.socket(zmq.PUSH)
            peer.setsockopt(zmq.SNDHWM, 4)  # one pending wake-up is as good as many
            peer.connect(addr)
            self.sockets.append(peer)

    def wake(self) -> None:
        for peer in self.sockets:
            try:
                peer.send(msg.encode(msg.Wake()), zmq.NOBLOCK)
            except zmq.Again:  # wake-ups already queued there
                pass

    def close(self) -> None:
        for peer in self.sockets:
            peer.close(0)
        self.ctx.term()
