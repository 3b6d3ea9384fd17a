"""OpenTelemetry traces of a request across the router, prefill, the KV transfer and decode.

Off unless `--otlp-traces-endpoint` is given (the router's and each worker's flag, as SGLang and vLLM name it);
then each HTTP process (the router, a worker's front end) holds one `Tracer`, which exports its spans over
OTLP/HTTP in batches from the SDK's background thread. One request's trace:

  router   `router POST /v1/...` (SERVER; continues the client's W3C `traceparent`, else starts the trace)
             `admission`: from its arrival to its handler (body read, slot taken)
             `attempt` per pair tried (a retry, and each migration of a stream, is another attempt)
               `prefill` and `decode` (CLIENT): the two legs; each sends its own context as `traceparent`
  worker   `prefill POST /v1/...` / `decode POST /v1/...` (SERVER, child of its leg)
             `admission`, then the stages its scheduler process went through (below), and the finish reason

The scheduler process is a separate process and runs no SDK. A sampled request is sent to it with
`GenerateReq.traced`; the engine then keeps a `request.trail.Trail` on the request, on which its queues mark
wall-clock start and end times (prefill: `prefill.bootstrap`, `scheduler.waiting`, a `forward` per prompt chunk,
`kv.transfer` with its pages, bytes and peer; decode: `decode.prealloc`, `kv.transfer`, `first_token`,
`decoding`), and each `TokenOut` brings the stages that ended back. The front end makes them spans under its
server span with those times (`Tracer.stages`): no context object crosses into the scheduler process, and
the spans of one request come from the process that holds its trace context.

Sampling: a server decides for its own clients at `--otlp-traces-sampling-ratio`, whatever sampled flag their
`traceparent` carries (it still joins their trace): a client cannot make its requests expensive. Only a peer's
parent is followed (`Trust`): a worker follows the router's decision, carried by the `traceparent` of each leg, so
the router's trace goes on in the workers as one trace.

Off, nothing of this exists: no `Tracer` (every caller holds None), no middleware, no `traced` request, and the
engine's only cost is calling the methods of the trail every untraced request holds, `request.trail.NO_TRAIL`,
which do nothing.
"""

from __future__ import annotations

import enum
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from disagg_worker.request.trail import Stage

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace.sampling import Sampler, SamplingResult
    from opentelemetry.trace import Link, Span, SpanKind
    from opentelemetry.util.types import Attributes

OTLP_TRACES_PATH = "/v1/traces"
# The context key that marks a request's remote parent as its peer's (set by `Tracer.server_span`).
_PEER_PARENT = "disagg.peer-parent"


class Trust(enum.Enum):
    """Whose `traceparent` sampled flag a server follows."""

    NONE = "none"  # the router, a monolithic server: their callers are clients
    PEER = "peer"  # a worker holding the model's secret: only requests let in with the router's worker token
    ALL = "all"  # a worker without one: only the router calls it (`serve --local`, a test stack)


def edge_sampler(ratio: float) -> Sampler:
    """Parent-based sampling at `ratio` for new traces and for the parents of peers; for a remote parent a client
    sent, the server's own draw at `ratio`: random, not by trace id, since a client chooses its trace id (and
    TraceIdRatioBased samples the low ids at any ratio above 0)."""
    from opentelemetry import context as otel_context
    from opentelemetry import trace
    from opentelemetry.sdk.trace.sampling import Decision, ParentBased, Sampler, SamplingResult, TraceIdRatioBased

    class EdgeSampler(Sampler):
        def __init__(self) -> None:
            self.follow = ParentBased(TraceIdRatioBased(ratio))

        def should_sample(
            self,
            parent_context: Context | None,
            trace_id: int,
            name: str,
            kind: SpanKind | None = None,
            attributes: Attributes = None,
            links: Sequence[Link] | None = None,
            trace_state: Any = None,
        ) -> SamplingResult:
            parent = trace.get_current_span(parent_context).get_span_context()
            peer = otel_context.get_value(_PEER_PARENT, parent_context) is True
            if not parent.is_valid or not parent.is_remote or peer:
                return self.follow.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)
            decision = Decision.RECORD_AND_SAMPLE if random.random() < ratio else Decision.DROP
            return SamplingResult(decision, attributes if decision.is_sampled() else None, parent.trace_state)

        def get_description(self) -> str:
            return f"EdgeSampler{{{ratio}}}"

    return EdgeSampler()


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of `--otlp-traces-endpoint`: `host:port` or a URL (without a path, /v1/traces)."""
    url = endpoint if "://" in endpoint else f"http://{endpoint}"
    scheme, _, rest = url.partition("://")
    return url if "/" in rest.rstrip("/") else f"{scheme}://{rest.rstrip('/')}{OTLP_TRACES_PATH}"


class Tracer:
    """One process's spans, exported to one OTLP/HTTP endpoint; `create` returns None when tracing is off."""

    def __init__(self, role: str, endpoint: str, ratio: float = 1.0, exporter: Any = None, trust: Trust = Trust.NONE):
        """`role`: router, prefill, decode or monolithic (the service is `disagg-<role>`); `exporter`: where spans
        go (default: OTLP/HTTP to `endpoint`; a test passes an in-memory one); `trust`: whose sampled flag it
        follows (`Trust`)."""
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.role, self.trust = role, trust
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": f"disagg-{role}"}), sampler=edge_sampler(ratio)
        )
        self.provider.add_span_processor(BatchSpanProcessor(exporter or OTLPSpanExporter(traces_url(endpoint))))
        self.tracer = self.provider.get_tracer("disagg")
        self.propagator = TraceContextTextMapPropagator()

    @classmethod
    def create(cls, role: str, endpoint: str, ratio: float = 1.0, trust: Trust = Trust.NONE) -> Tracer | None:
        return cls(role, endpoint, ratio, trust=trust) if endpoint else None

    def shutdown(self) -> None:
        """Export what is left and stop the export thread."""
        self.provider.shutdown()

    @contextmanager
    def server_span(
        self, name: str, headers: Mapping[str, str], start_ns: int | None = None, peer: bool = False, **attrs: Any
    ) -> Iterator[Span]:
        """A request's span in this process, begun now or at `start_ns`, the current span while the block runs: a
        child of the W3C context in `headers` (its `traceparent`), else the root of a new trace. `peer`: the
        request was let in with the router's worker token; whether its sampled flag is followed is `trust`'s."""
        from opentelemetry import context as otel_context
        from opentelemetry import trace

        parent = self.propagator.extract(headers)
        if self.trust is Trust.ALL or (self.trust is Trust.PEER and peer):
            parent = otel_context.set_value(_PEER_PARENT, True, parent)
        kind = trace.SpanKind.SERVER
        span = self.tracer.start_span(name, context=parent, kind=kind, attributes=attrs, start_time=start_ns)
        with trace.use_span(span, end_on_exit=True, record_exception=False, set_status_on_exception=True):
            yield span

    def start(
        self,
        name: str,
        attrs: Mapping[str, Any] | None = None,
        parent: Span | None = None,
        client: bool = False,
        start_ns: int | None = None,
    ) -> Span:
        """A span with `attrs` under `parent` (default: the current span), begun now or at `start_ns`; `client`: a
        call to another process."""
        from opentelemetry import trace

        context = trace.set_span_in_context(parent) if parent is not None else None
        kind = trace.SpanKind.CLIENT if client else trace.SpanKind.INTERNAL
        return self.tracer.start_span(name, context=context, kind=kind, attributes=attrs, start_time=start_ns)

    def headers(self, span: Span) -> dict[str, str]:
        """The W3C headers (`traceparent`) that make the receiver's spans children of `span`."""
        from opentelemetry import trace

        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    @staticmethod
    def current() -> Span | None:
        """The current span if it is sampled (its request is traced), else None."""
        from opentelemetry import trace

        span = trace.get_current_span()
        return span if span.is_recording() else None

    def stages(self, parent: Span, stages: tuple[Stage, ...]) -> None:
        """The scheduler's stages of a request (`request/trail.py`) as spans under `parent`, with their times."""
        for s in stages:
            self.span_between(s.name, parent, s.start_ns, s.end_ns, **s.attrs)

    def span_between(self, name: str, parent: Span, start_ns: int, end_ns: int | None = None, **attrs: Any) -> None:
        """A span under `parent` that began at `start_ns` and ended at `end_ns` (default: now)."""
        span = self.start(name, attrs, parent, start_ns=start_ns)
        span.end(end_time=end_ns if end_ns is not None else time.time_ns())


def end_span(span: Span, error: str = "") -> None:
    """End `span`, as failed with `error` when one is given."""
    if error:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end()
