"""A stalled stream: its decode's fault, or its own.

A streamed choice whose decode sends nothing for `--stream-stall-timeout` has stalled (`stream.py`). Its decode
is stalled too when none of its streams delivered an event meanwhile (each migrating stream stamps its decode's
`Worker.last_event` as its events pass, `migrate.py`): an engine stuck while its HTTP side still answers /health.
Such a decode is held out of rotation for `--stall-hold` seconds, before the stream migrates, so that neither the
migrating streams nor new requests are placed on it; the pool's picks and pair verification skip it meanwhile
(`Worker.available`), /health shows it (`held_out_s`) and /metrics counts the verdicts. A decode that delivered
on its other streams meanwhile is making progress: the request itself is slow, and the decode stays in rotation.

Either way a choice migrates for a stall once: a request that is slow on its own would stall the next decode too,
and with its whole prompt and output at each hop. Its second stall ends its stream with an error event, as the
migration limit does; failures of other causes keep that limit.
"""

from __future__ import annotations

import logging
from enum import Enum

from disagg_worker.router.worker import Worker
from disagg_worker.tuning import TUNING

log = logging.getLogger(__name__)
STALL = "stall"  # UpstreamLost's cause for a stream that sent nothing within the stall timeout
STALL_MIGRATIONS = 1  # how often a choice migrates for a stall


class Verdict(str, Enum):
    """Whose a stall is: the decode's (held out) or the request's (the decode stays in rotation)."""

    DECODE = "decode"
    REQUEST = "request"


def verdict(last_event: float, now: float, stall_s: float, silence: float | None = None) -> Verdict:
    """The decode is stalled when none of its streams delivered an event for `silence` of the stall timeout
    (`RouterTuning.stalled_decode_silence`) up to `now`; `last_event`: when one last did."""
    share = TUNING.router.stalled_decode_silence if silence is None else silence
    return Verdict.DECODE if now - last_event >= stall_s * share else Verdict.REQUEST


def judge(decode: Worker, now: float, stall_s: float, hold_s: float) -> Verdict:
    """A stream from `decode` stalled: hold `decode` out until `now + hold_s` if it is stalled itself."""
    v = verdict(decode.last_event, now, stall_s)
    if v is Verdict.REQUEST:
        log.info("a stream from decode %s stalled while its other streams went on: the request is slow", decode.url)
        return v
    if not decode.held_out(now):
        log.warning(
            "decode %s sent nothing on any stream for %.1f s: held out of rotation for %.0f s",
            decode.url,
            now - decode.last_event,
            hold_s,
        )
    decode.hold_out(now + hold_s)
    return v


def may_migrate(cause: str, stalls: int) -> bool:
    """Whether a choice that failed with `cause`, having stalled `stalls` times (this one included), may migrate
    for it: a stall once, any other cause as the migration limit allows."""
    return cause != STALL or stalls <= STALL_MIGRATIONS
