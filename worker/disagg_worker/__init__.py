"""disagg's serving engine: prefill/decode disaggregation, a KV-aware router, an OpenAI-compatible API.

The path of one chat request through a P/D deployment (imports run one way, from the router down to the
request's own types in request/; `tests/unit/test_imports.py` holds the floors):

  router/app.py            admits it, picks a prefill/decode pair (workers.py, by router/policies/) and adds the
                           signed bootstrap target (request/route.py); posts it to both, streams decode's
  server/endpoints/chat.py each worker: parses and validates the body (server/protocol.py ->
                           request/params.py, request/limits.py) into a 4xx naming the field, or on
  server/frontend.py       tokenizes it (model/tokenizer.py), sends a GenerateReq over zmq
                           (request/messages.py) to the scheduler process
  instance/loop.py         the scheduler process receives it and steps the engine
  engine/engine.py         hands it to the role stage, then to the scheduler:
    engine/prefill.py        prefill: bootstrap queue -> waiting -> forward -> KV sent -> inflight
    engine/decode.py         decode: prealloc pages -> KV received -> running
  engine/scheduler.py      continuous batching over the paged KV pool and prefix cache (mem/)
  engine/runner.py         forward (model/) and sampling; a failing row fails its request alone
  disagg/                  the KV pages move prefill -> decode: bootstrap server, control channel,
                           Mooncake transfer engine (RDMA on GPUs, TCP otherwise)
  engine/outbox.py         new tokens go back to the HTTP process as TokenOut
  server/frontend.py       detokenizes, and server/endpoints/chat.py (over base.py) streams OpenAI's chunks

With --otlp-traces-endpoint the router and each HTTP process make OpenTelemetry spans of it (tracing.py),
the scheduler's stages among them (request/trail.py).

Settings flow down one frozen chain (config.py, from the flags of cli_args.py); ranks/ is how the ranks
of a multi-GPU instance work together, instance/ the processes that run them.
"""
