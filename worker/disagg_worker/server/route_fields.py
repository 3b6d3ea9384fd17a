"""The routing fields a request body may carry: the P/D bootstrap target the router adds, the attention group
(DP attention) and `local_prefill` (decode computes the prompt itself). Absent in monolithic use."""

from __future__ import annotations

from disagg_worker.messages import BootstrapInfo, Route
from disagg_worker.server.errors import APIError


def route_of(body) -> Route:
    """Where the request runs: the P/D bootstrap target the router adds (absent in monolithic use), and the
    attention group it names (`data_parallel_rank`, SGLang's field; DP attention)."""
    dp = body.get("data_parallel_rank") if isinstance(body, dict) else None
    if dp is not None and not _count(dp):
        raise APIError(400, "data_parallel_rank must be a non-negative integer", param="data_parallel_rank")
    local = body.get("local_prefill", False) if isinstance(body, dict) else False
    if not isinstance(local, bool):
        raise APIError(400, "local_prefill must be a boolean", param="local_prefill")
    bootstrap = bootstrap_of(body)
    if local and bootstrap is not None:
        raise APIError(400, "local_prefill and bootstrap_room exclude each other", param="local_prefill")
    sig = body.get("bootstrap_sig", "") if local else ""
    if not isinstance(sig, str):
        raise APIError(400, "bootstrap_sig must be a string", param="bootstrap_sig")
    return Route(bootstrap, dp, local, sig)


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def bootstrap_of(body) -> BootstrapInfo | None:
    """P/D fields the router adds to a request body (absent in monolithic use)."""
    if not isinstance(body, dict) or "bootstrap_room" not in body:
        return None
    dp = body.get("bootstrap_dp_rank")
    if dp is not None and not _count(dp):
        raise APIError(400, "bootstrap_dp_rank must be a non-negative integer", param="bootstrap_dp_rank")
    host, port, room = body.get("bootstrap_host"), body.get("bootstrap_port"), body.get("bootstrap_room")
    sig = body.get("bootstrap_sig", "")
    if not isinstance(sig, str):
        raise APIError(400, "bootstrap_sig must be a string", param="bootstrap_sig")
    if (
        not isinstance(host, str)
        or "/" in host  # the signature covers host and group as "host/dp/k": a host holds no "/"
        or not isinstance(port, int)
        or not isinstance(room, int)
        or isinstance(port, bool)
        or isinstance(room, bool)
        or not 0 <= room < 2**63
    ):
        raise APIError(
            400,
            "bootstrap_host (str), bootstrap_port (int) and bootstrap_room (0..2^63-1) are required together",
            param="bootstrap_room",
        )
    return BootstrapInfo(host, port, room, sig, dp)
