"""The prefill a gateway names for a request (llm-d's `x-prefiller-host-port: host:port`), checked against the
decode instance's allow-list (`--prefill-allow`) before anything is sent there.

A decode that performs the hand-off (`decode_handoff.py`) sends the prompt, and with the model's secret its worker
token, to the prefill the header names; whoever reaches the decode's port can set the header, so an unchecked
header would make the decode a proxy to hosts of the caller's choosing. A header is taken only when its host is:
- with no list (the default), a loopback address or `localhost`: a local deployment works as it is, and nothing
  leaves the machine;
- an address in one of the listed networks (`10.0.0.0/8`, `fd00::/8`, one address);
- a listed host name, or an address that a listed name resolves to (re-resolved at most every `RESOLVE_TTL_S`:
  the prefills' headless Service admits the pods it lists now, the addresses a gateway's picker names);
- anything at all with `*` (a network policy guards the pod instead).
A host name in the header is taken only when listed itself: it is never resolved to be checked against the
networks, since what it resolves to when the connection is made may differ from what was checked.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from disagg_worker.config import ConfigError
from disagg_worker.request.errors import APIError

HEADER = "x-prefiller-host-port"
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
LOOPBACK: tuple[Network, ...] = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
# How long a listed name's addresses are believed before it is resolved again.
RESOLVE_TTL_S = 5.0
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_NAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*\.?$")  # a DNS host name


@dataclass(frozen=True)
class Prefiller:
    """A prefill instance's HTTP address as a header named it: an address (IPv6 without brackets) or a name."""

    host: str
    port: int

    @property
    def address(self) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
        """The host as an address (None: a name)."""
        try:
            return ipaddress.ip_address(self.host)
        except ValueError:
            return None

    @property
    def url(self) -> str:
        return f"http://[{self.host}]:{self.port}" if ":" in self.host else f"http://{self.host}:{self.port}"


def bad_header(why: str) -> APIError:
    return APIError(400, f"{HEADER} {why}", param=HEADER)


def parse_header(value: str) -> Prefiller:
    """`host:port` (IPv6 as `[addr]:port`); a 400 naming the header otherwise."""
    value = value.strip()
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if ipaddress_or_none(host) is None:
            raise bad_header(f"must be host:port, an IPv6 address in brackets; got {value[:100]!r}")
    elif not sep or not (ipaddress_or_none(host) or _NAME.match(host)) or ":" in host:
        raise bad_header(f"must be host:port (the prefill instance's HTTP address); got {value[:100]!r}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise bad_header(f"must end with a port from 1 to 65535; got {value[:100]!r}")
    return Prefiller(host.lower(), int(port))


def ipaddress_or_none(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


@dataclass(frozen=True)
class AllowList:
    """The prefills a header may name (`--prefill-allow`)."""

    networks: tuple[Network, ...] = LOOPBACK
    names: tuple[str, ...] = ("localhost",)
    anything: bool = False

    @classmethod
    def parse(cls, spec: str) -> AllowList:
        """Comma-separated CIDRs, addresses, host names or `*`; empty: loopback only. A bad entry: ConfigError."""
        entries = [e.strip() for e in spec.split(",") if e.strip()]
        if not entries:
            return cls()
        networks: list[Network] = []
        names: list[str] = []
        for e in entries:
            if e == "*":
                return cls((), (), anything=True)
            try:
                networks.append(ipaddress.ip_network(e, strict=False))
                continue
            except ValueError:
                pass
            if not _NAME.match(e) or e.replace(".", "").isdigit():
                raise ConfigError(f"--prefill-allow: {e!r} is not a CIDR, an address, a host name or *")
            names.append(e.lower().rstrip("."))
        return cls(tuple(networks), tuple(names))

    def admits(self, p: Prefiller, resolved: Mapping[str, frozenset[str]] | None = None) -> bool:
        """Whether `p` may be sent the prefill leg; `resolved`: the addresses of the listed names (None: unknown)."""
        if self.anything:
            return True
        address = p.address
        if address is None:
            return p.host.rstrip(".") in self.names
        if any(address in net for net in self.networks):
            return True
        return resolved is not None and any(str(address) in resolved.get(name, frozenset()) for name in self.names)


@dataclass
class NameResolver:
    """The addresses of the listed names, each resolved at most every `ttl_s` (a failure: no addresses)."""

    ttl_s: float = RESOLVE_TTL_S
    clock: Callable[[], float] = time.monotonic
    known: dict[str, tuple[float, frozenset[str]]] = field(default_factory=dict)

    async def addresses(self, names: Iterable[str]) -> dict[str, frozenset[str]]:
        out = {}
        for name in names:
            at, found = self.known.get(name, (float("-inf"), frozenset()))
            if self.clock() - at >= self.ttl_s:
                found = await _resolve(name)
                self.known[name] = (self.clock(), found)
            out[name] = found
        return out


async def _resolve(name: str) -> frozenset[str]:
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except OSError:
        return frozenset()
    return frozenset(str(ipaddress.ip_address(str(info[4][0]).split("%")[0])) for info in infos)


async def checked(value: str, allow: AllowList, resolver: NameResolver) -> Prefiller:
    """The prefill the header names, if the allow-list admits it; a 400 naming the header otherwise."""
    p = parse_header(value)
    if allow.admits(p) or (p.address is not None and allow.admits(p, await resolver.addresses(allow.names))):
        return p
    raise bad_header(f"names {p.host}, which this decode instance's --prefill-allow does not admit")
