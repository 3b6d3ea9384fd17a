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

Sampling: the router samples new traces at `--otlp-traces-sampling-ratio` (or follows the client's sampled
flag); the workers follow their parent. Off, nothing of this exists: no `Tracer` (every caller holds None), no
middleware, no `traced` request, and the engine's only cost is calling the methods of the trail every untraced
request holds, `request.trail.NO_TRAIL`, which do nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from disagg_worker.request.trail import Stage

if TYPE_CHECKING:
    from opentelemetry.trace import Span

OTLP_TRACES_PATH = "/v1/traces"


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of `--otlp-traces-endpoint`: `host:port` or a URL (without a path, /v1/traces)."""
    url = endpoint if "://" in endpoint else f"http://{endpoint}"
    scheme, _, rest = url.partition("://")
    return url if "/" in rest.rstrip("/") else f"{scheme}://{rest.rstrip('/')}{OTLP_TRACES_PATH}"


class Tracer:
    """One process's spans, exported to one OTLP/HTTP endpoint; `create` returns None when tracing is off."""

    def __init__(self, role: str, endpoint: str, ratio: float = 1.0, exporter: Any = None):
        """`role`: router, prefill, decode or monolithic (the service is `disagg-<role>`); `exporter`: where spans
        go (default: OTLP/HTTP to `endpoint`; a test passes an in-memory one)."""
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.role = role
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": f"disagg-{role}"}), sampler=ParentBased(TraceIdRatioBased(ratio))
        )
        self.provider.add_span_processor(BatchSpanProcessor(exporter or OTLPSpanExporter(traces_url(endpoint))))
        self.tracer = self.provider.get_tracer("disagg")
        self.propagator = TraceContextTextMapPropagator()

    @classmethod
    def create(cls, role: str, endpoint: str, ratio: float = 1.0) -> Tracer | None:
        return cls(role, endpoint, ratio) if endpoint else None

    def shutdown(self) -> None:
        """Export what is left and stop the export thread."""
        self.provider.shutdown()

    @contextmanager
    def server_span(
        self, name: str, headers: Mapping[str, str], start_ns: int | None = None, **attrs: Any
    ) -> Iterator[Span]:
        """A request's span in this process, begun now or at `start_ns`, the current span while the block runs: a
        child of the W3C context in `headers` (its `traceparent`), else the root of a new trace."""
        from opentelemetry import trace

        parent = self.propagator.extract(headers)
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
