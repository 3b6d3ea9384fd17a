"""The HTTP kit both front ends use, a worker's (`server/`) and the router's (`router/`): transport, not OpenAI.

- `admission.py`   the gate in front of generation requests: 503 draining or broken, 429 over the in-flight
                   bound or the budget of body bytes, 413 over the body limit; the body read first (`body.py`:
                   within a size and a time limit), then handed to the handler (`body_of`);
- `flow_gate.py`   with flow control on, where a request waits for a slot instead of a 429 (`disagg_worker.flow`:
                   priority bands, flows round-robin, a bounded queue with a time to live);
- `errors.py`      errors as OpenAI bodies, a bug as a 500 that names a log id (the error middleware);
- `middlewares.py` the middlewares of a front end in their order (errors, admission, tracing);
- `traced.py`      a generation request's server span and its admission span, with tracing on;
- `auth.py`        bearer-token authentication (the probe paths open);
- `drain.py`       the graceful drain on SIGTERM;
- `probe.py`       the header that marks the router's pair probes.

It knows nothing of engines, endpoints or routing: it imports neither `server` nor `router`, which both import
it. The OpenAI parsing both share is `server/protocol.py`'s.
"""
