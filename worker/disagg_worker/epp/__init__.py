"""The endpoint picker (`disagg epp`): a Gateway API gateway (Istio, kgateway, Envoy Gateway, or an Envoy
configured as they configure it) asks it, over Envoy's external-processing protocol, which pod of an
InferencePool serves each request, and it answers with the router's own choice (docs/gateway.md).

Path of a request: the gateway's ext_proc stream (`service.py`) -> `exchange.py` (headers, the body gathered
within its limit) -> `request_body.py` (the workers' parsers check it; the prompt cache_aware scores) ->
`pick.py` (the router's pool and policy pick an endpoint within the subset hint, and in P/D mode a prefill
beside the decode, or refuse: 503, 429) -> `answers.py` (destination header and `envoy.lb` metadata, in P/D mode
`x-prefiller-host-port`, the body streamed back, or an ImmediateResponse) -> the gateway sends the request to
the endpoint (in P/D mode a decode, which runs the prefill leg itself); its response headers come back through the
stream (`metrics.py`: which endpoint served). The protocol's types are Envoy's own, generated from its .proto files
(`generated/`).
"""
