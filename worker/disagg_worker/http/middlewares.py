"""The middlewares of an HTTP front end, a worker's (`server/api.py`) and the router's (`router/server.py`) alike:
errors (`errors.py`), then the admission gate (`admission.py`), and with tracing on the request's span around
them and the admission's span after the gate (`traced.py`)."""

from __future__ import annotations

from disagg_worker.http.admission import Admission, admission_middleware
from disagg_worker.http.errors import error_middleware
from disagg_worker.http.traced import traced_middlewares
from disagg_worker.tracing import Tracer


def with_tracing(tracer: Tracer | None, admission: Admission) -> list:
    """The middlewares of a front end: errors, admission, and with a tracer the request's span around them."""
    middlewares = [error_middleware, admission_middleware(admission)]
    if tracer is None:
        return middlewares
    first, admitted = traced_middlewares(tracer)
    return [first, *middlewares, admitted]
