"""Blocking HTTP calls to a bootstrap server (run them off the scheduler thread)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass

from disagg_worker.disagg.bootstrap import RankRegistration


class BootstrapError(RuntimeError):
    """The server answered with an error that waiting will not fix (4xx)."""


@dataclass(frozen=True)
class Topology:
    instance_id: str
    tp_size: int
    pp_size: int
    page_size: int
    kv_dtype: str
    ranks: list[RankRegistration]

    def rank(self, tp_rank: int, pp_rank: int) -> RankRegistration:
        return next(r for r in self.ranks if (r.tp_rank, r.pp_rank) == (tp_rank, pp_rank))


def base_url(bootstrap_addr: str) -> str:
    """`host:port` (what the router puts in a request) -> `http://host:port`."""
    return bootstrap_addr if bootstrap_addr.startswith("http") else f"http://{bootstrap_addr}"


def _call(method: str, url: str, token: str, body: dict | None, timeout: float) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {"error": e.reason}


def register_rank(url: str, reg: RankRegistration, token: str = "", timeout: float = 2.0) -> None:
    """PUT /route; raises BootstrapError on a 4xx, OSError when unreachable."""
    status, body = _call("PUT", f"{base_url(url)}/route", token, asdict(reg), timeout)
    if status != 200:
        raise BootstrapError(f"registration refused ({status}): {body.get('error', body)}")


def fetch_topology(url: str, token: str = "", timeout: float = 2.0) -> Topology | None:
    """GET /route for all ranks; None while the instance is incomplete (503)."""
    status, body = _call("GET", f"{base_url(url)}/route?tp_rank=-1&pp_rank=-1", token, None, timeout)
    if status == 503:
        return None
    if status != 200:
        raise BootstrapError(f"topology query refused ({status}): {body.get('error', body)}")
    try:  # the instance is complete: a topology this process cannot read will not get better by waiting
        ranks = [RankRegistration.from_json(r) for r in body["ranks"]]
        return Topology(
            instance_id=body["instance_id"],
            tp_size=body["tp_size"],
            pp_size=body["pp_size"],
            page_size=body["page_size"],
            kv_dtype=body["kv_dtype"],
            ranks=ranks,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise BootstrapError(f"malformed topology from {url}: {e!r}") from None


# check_health's answer when nothing listens on the bootstrap port: the instance is gone, not slow.
REFUSED = "<refused>"


def check_health(url: str, timeout: float = 1.0) -> str | None:
    """The instance id if GET /health answers 200, REFUSED if the connection is refused, else None."""
    try:
        status, body = _call("GET", f"{base_url(url)}/health", "", None, timeout)
    except ConnectionRefusedError:
        return REFUSED
    except urllib.error.URLError as e:
        return REFUSED if isinstance(e.reason, ConnectionRefusedError) else None
    except (OSError, ValueError):
        return None
    return body.get("instance_id") if status == 200 else None
