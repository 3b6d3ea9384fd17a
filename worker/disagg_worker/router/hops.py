"""A choice's attempts as spans (`disagg_worker.tracing`): one `Hop` per pair the router tries.

A hop is an `attempt` span under the request's span with a `prefill` and a `decode` client span under it;
each leg's request carries its own span's W3C context (`headers`), so that the worker's spans hang under it. A
hop that fails (a retry follows) or whose decode fails mid-stream (a migration follows) ends with an error
status naming why; the one that answers ends when the client's stream does (`Router.close`). An attempt that
is not traced (tracing off, or a request not sampled) holds `NO_HOP`, which records nothing and sends no
headers, so the router's attempt paths read the same either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from disagg_worker.router.worker import Worker
from disagg_worker.tracing import Tracer, end_span

if TYPE_CHECKING:
    from opentelemetry.trace import Span


class Hop:
    def __init__(self, tracer: Tracer, number: int, p: Worker | None, d: Worker, resumed: int = 0):
        """Attempt `number` (0: the first) of a choice on `p` (None: decode computes the prompt) and `d`; `resumed`:
        tokens a migrated stream goes on from."""
        attrs: dict[str, str | int] = {
            "disagg.attempt": number,
            "disagg.decode": d.url,
            "disagg.resumed_tokens": resumed,
        }
        if p is not None:
            attrs["disagg.prefill"] = p.url
        self.span = tracer.start("attempt", attrs)
        self.prefill: Span | None = None
        if p is not None:
            self.prefill = tracer.start("prefill", {"server.address": p.url}, self.span, client=True)
        self.decode = tracer.start("decode", {"server.address": d.url}, self.span, client=True)
        self.prefill_headers: Mapping[str, str] = tracer.headers(self.prefill) if self.prefill is not None else {}
        self.decode_headers: Mapping[str, str] = tracer.headers(self.decode)

    def prefill_answered(self, status: int) -> None:
        if self.prefill is not None:
            self.prefill.set_attribute("http.response.status_code", status)
            end_span(self.prefill, "" if status == 200 else f"prefill answered {status}")

    def end(self, error: str = "", status: int = 0) -> None:
        """The hop is over: its decode stream ended (or never started: `error`, decode's `status`)."""
        if status:
            self.decode.set_attribute("http.response.status_code", status)
        end_span(self.decode, error)
        end_span(self.span, error)


class NoHop(Hop):
    """The hop of an attempt that is not traced: no spans, and no headers for its legs (an empty mapping, which
    aiohttp treats as none). It records nothing, so one (`NO_HOP`) serves every such attempt."""

    def __init__(self) -> None:
        self.prefill_headers = self.decode_headers = MappingProxyType({})

    def prefill_answered(self, status: int) -> None:
        pass

    def end(self, error: str = "", status: int = 0) -> None:
        pass


NO_HOP = NoHop()
