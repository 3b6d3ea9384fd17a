"""The routing fields of a request body, written by the router and read by the workers, in one place: the P/D
bootstrap target (signed with the model's target key), the attention group (DP attention) and `local_prefill`
(decode computes the prompt itself). Absent in monolithic use."""

from __future__ import annotations

from disagg_worker import keys
from disagg_worker.request.errors import APIError
from disagg_worker.request.messages import BootstrapInfo, Route

# Every field the router sets; a client's own values for them are dropped (`router/payload.py`).
FIELDS = (
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_sig",
    "bootstrap_dp_rank",
    "data_parallel_rank",
    "local_prefill",
    "resume_token_ids",
    "resume_text_chars",
)


ROUTER_ONLY = "{} are set by this model's router on the requests it routes, never by a client"


def target_fields(key: str, host: str, port: int, room: int, dp_rank: int | None = None) -> dict:
    """The bootstrap fields of one routed request (with DP attention, the prefill's attention group), signed
    when the model has a target key (the group with the host: `BootstrapInfo.signed_host`)."""
    out: dict = {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}
    signed = host
    if dp_rank is not None:
        out["bootstrap_dp_rank"] = dp_rank
        signed = f"{host}/dp/{dp_rank}"
    if key:
        out["bootstrap_sig"] = keys.sign_target(key, signed, port, room)
    return out


def local_prefill_fields(key: str) -> dict:
    """The fields of a request decode computes itself, signed when the model has a target key."""
    out: dict = {"local_prefill": True}
    if key:
        out["bootstrap_sig"] = keys.sign_target(key, keys.LOCAL_PREFILL, 0, 0)
    return out


def group_fields(group: int | None) -> dict:
    """The field naming a worker's attention group (none for a worker of one group)."""
    return {} if group is None else {"data_parallel_rank": group}


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
    resume, chars = resume_of(body)
    if (resume or chars) and bootstrap is None and not local:
        # A migrated request comes from the router with its target (signed where the model has a key): a client's
        # own resume would put its text in the answer's mouth.
        field = "resume_token_ids" if resume else "resume_text_chars"
        raise APIError(400, ROUTER_ONLY.format("resume_token_ids and resume_text_chars"), param=field)
    return Route(bootstrap, dp, local, sig, resume, chars)


def check_unrouted(route: Route) -> None:
    """A monolithic server is reached by clients only (no router routes to it): a request naming a bootstrap
    target, local_prefill or a resume is a client's, and a 400 naming the field. Its stage would ignore the
    target and its signature, so a client's resume sent with bootstrap fields would otherwise be taken."""
    named = (
        ("bootstrap_room", route.bootstrap is not None),
        ("local_prefill", route.local_prefill),
        ("resume_token_ids", bool(route.resume)),
        ("resume_text_chars", route.resume_chars > 0),
    )
    for field, present in named:
        if present:
            message = f"{field} is set by a P/D model's router on the requests it routes; a monolithic server takes it"
            message += " from no one"
            raise APIError(400, message, param=field)


def resume_fields(token_ids: list[int], text_chars: int) -> dict:
    """The fields of a migrated request: the tokens it generated before its instance failed, and how many
    characters of their text its client has (the rest of their text is still to send)."""
    return {"resume_token_ids": token_ids, "resume_text_chars": text_chars}


def resume_of(body) -> tuple[tuple[int, ...], int]:
    ids = body.get("resume_token_ids", []) if isinstance(body, dict) else []
    if not isinstance(ids, list) or not all(_count(t) for t in ids):
        raise APIError(400, "resume_token_ids must be a list of token ids", param="resume_token_ids")
    chars = body.get("resume_text_chars", 0) if isinstance(body, dict) else 0
    if not _count(chars):
        raise APIError(400, "resume_text_chars must be a non-negative integer", param="resume_text_chars")
    return tuple(ids), chars


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
