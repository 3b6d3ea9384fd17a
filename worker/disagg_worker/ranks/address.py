"""Where the ranks of an instance meet; kept apart from `dist` (torch.distributed) so that the HTTP process,
which picks the address when it spawns the ranks, never imports torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankAddress:
    """Where the ranks of an instance meet (a TCP store on the driver's host)."""

    host: str
    port: int

    @classmethod
    def parse(cls, addr: str) -> RankAddress:
        host, _, port = addr.rpartition(":")
        return cls(host.strip("[]"), int(port))

    @property
    def init_method(self) -> str:
        return f"tcp://{self.host}:{self.port}"
