"""What the scheduler process sends back to the HTTP process: each request's new tokens.

The scheduler and a P/D role stage both end requests; they share one `Outbox`, and the loop
takes what accumulated after each step and sends it as one `BatchOut`.
"""

from __future__ import annotations

import logging
import re

from disagg_worker.engine.request import Req
from disagg_worker.request.messages import TokenOut
from disagg_worker.request.trail import Stage

log = logging.getLogger(__name__)
TopLogprobs = list[tuple[int, float]]


# What a transfer's failure reason may name that a client must not learn (a forgery would need it): addresses and
# endpoints, room ids, decode and instance ids. The words around them (the cause) stay.
_IDENTIFIERS = (
    (re.compile(r"\b[a-z]+://\S+"), "<endpoint>"),
    (re.compile(r"\[?[0-9a-fA-F:]*:[0-9a-fA-F:]+\]?:\d+|\b\d{1,3}(\.\d{1,3}){3}(:\d+)?"), "<address>"),
    (re.compile(r"\b[\w.-]*[a-zA-Z][\w.-]*:\d{2,5}\b"), "<address>"),  # host name:port
    (re.compile(r"\b(room|rooms)\s+\d+"), r"\1 <id>"),
    (re.compile(r"\b[0-9a-f]{16,}\b"), "<id>"),
)


def redact(reason: str) -> str:
    """`reason` without the identifiers a client must not learn."""
    for pattern, replacement in _IDENTIFIERS:
        reason = pattern.sub(replacement, reason)
    return reason


def transfer_error(rid: str, what: str, reason: str) -> str:
    """A client's message for a failed KV transfer: what failed and why, without the rooms, peers and addresses the
    reason names (logged whole here, under the request id)."""
    log.warning("request %s: %s: %s", rid, what, reason)
    return f"{what}: {redact(reason)} (the server log has the details under request id {rid})"


def internal_error(rid: str, what: str) -> str:
    """A client's message for a request that failed on its own: where to look, never the exception."""
    return f"Internal error while {what}; the server log has the details under request id {rid}."


class Outbox:
    def __init__(self) -> None:
        self._outs: list[TokenOut] = []

    def emit(self, req: Req, tokens: list[int], logprob: float | None = None, top: TopLogprobs | None = None) -> None:
        """Queue `tokens` (new since the last emit) of `req`; its last emit carries the finish reason."""
        self._outs.append(
            TokenOut(
                **_prompt_scores(req),
                stages=_stages(req, len(tokens)),
                rid=req.rid,
                token_ids=tokens,
                logprobs=[logprob] if logprob is not None else None,
                top_logprobs=[top] if top is not None else None,
                finish_reason=req.finish_reason.value if req.finish_reason is not None else None,
                prompt_tokens=len(req.prompt_ids),
                cached_tokens=req.cached_tokens,
                error=req.error,
                error_status=req.error_status,
                error_code=req.error_code,
            )
        )

    def emit_run(
        self,
        req: Req,
        tokens: list[int],
        logprobs: list[float | None] | None = None,
        tops: list[TopLogprobs | None] | None = None,
    ) -> None:
        """Queue several tokens of `req` sampled in one step (a verified speculative draft) as one output."""
        self._outs.append(
            TokenOut(
                **_prompt_scores(req),
                stages=_stages(req, len(tokens)),
                rid=req.rid,
                token_ids=tokens,
                logprobs=[lp for lp in logprobs if lp is not None] if logprobs else None,
                top_logprobs=[t for t in tops if t is not None] if tops else None,
                finish_reason=req.finish_reason.value if req.finish_reason is not None else None,
                prompt_tokens=len(req.prompt_ids),
                cached_tokens=req.cached_tokens,
                error=req.error,
                error_status=req.error_status,
                error_code=req.error_code,
            )
        )

    def reject(self, req: Req, status: int, message: str, code: str = "") -> None:
        """End `req` with an error (it holds no pages)."""
        req.fail(status, message, code)
        self.emit(req, [])

    def take(self) -> list[TokenOut]:
        outs, self._outs = self._outs, []
        return outs


def _prompt_scores(req: Req) -> dict:
    """The prompt's logprobs, with the request's first output (then forgotten: sent once)."""
    if not req.prompt_logprobs:
        return {}
    scores, req.prompt_logprobs = req.prompt_logprobs, []
    return {"prompt_logprobs": [lp for lp, _ in scores], "prompt_top_logprobs": [top for _, top in scores]}


def _stages(req: Req, new_tokens: int) -> tuple[Stage, ...]:
    """A traced request's stages that ended, with each output (none for an untraced one, whose trail records
    nothing): its first tokens mark `first_token` and begin `decoding` (not on prefill, which hands the request
    off), and its end ends every stage still open."""
    trail = req.trail
    if new_tokens and len(req.output_ids) == new_tokens and not req.handoff:
        trail.mark("first_token")
        trail.begin("decoding")
    if req.finish_reason is not None:
        trail.finish(finish_reason=req.finish_reason.value, output_tokens=len(req.output_ids))
    return trail.take()
