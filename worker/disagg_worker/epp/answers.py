"""The ext_proc messages of the endpoint picker protocol (GIE's, v1), in Envoy's own types (`generated/`): what
the gateway sends that the picker reads (headers, the subset hint, the endpoint that served), and the answers it
sends back: the pick (header `x-gateway-destination-endpoint` and the same value in the dynamic metadata
`envoy.lb`; in P/D mode the prefill in header `x-prefiller-host-port`, llm-d's), the body streamed back
(FULL_DUPLEX_STREAMED), and the refusals as ImmediateResponses carrying the OpenAI error body the router would
give.
"""

from __future__ import annotations

import json

from google.protobuf import struct_pb2

from disagg_worker.epp.generated.envoy.config.core.v3 import base_pb2 as core
from disagg_worker.epp.generated.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from disagg_worker.request.errors import APIError
from disagg_worker.router.prefiller import HEADER

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
PREFILLER = HEADER  # llm-d's header naming the prefill to a decode (`router/prefiller.py`)
LB = "envoy.lb"
SUBSET_HINT = "envoy.lb.subset_hint"
# The most of a body one StreamedBodyResponse carries back (gRPC's default message bound is 4 MiB).
CHUNK_BYTES = 1 << 20
OVERWRITE = core.HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD
# The messages the picker lets through unchanged (`passed`).
PASSED = ("response_headers", "request_trailers", "response_trailers")


def headers_of(m: core.HeaderMap) -> dict[str, str]:
    """A header map as lower-case names to values (Envoy sends `raw_value`; older ones `value`)."""
    return {h.key.lower(): h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value for h in m.headers}


def subset_of(req: pb.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints the gateway allows (filter metadata `envoy.lb.subset_hint`), None when it names none."""
    hint = req.metadata_context.filter_metadata.get(SUBSET_HINT)
    if hint is None or SUBSET not in hint.fields:
        return None
    value = hint.fields[SUBSET]
    if value.HasField("list_value"):
        return frozenset(v.string_value for v in value.list_value.values if v.string_value)
    return frozenset(s.strip() for s in value.string_value.split(",") if s.strip())


def served_of(req: pb.ProcessingRequest, headers: dict[str, str]) -> str:
    """The endpoint that served the request, as the gateway reports it: the metadata `envoy.lb` the protocol
    names, else a response header of the same name; "" when neither says."""
    lb = req.metadata_context.filter_metadata.get(LB)
    if lb is not None and SERVED in lb.fields and lb.fields[SERVED].string_value:
        return lb.fields[SERVED].string_value
    return headers.get(SERVED, "")


def _header(name: str, value: str) -> core.HeaderValueOption:
    return core.HeaderValueOption(header=core.HeaderValue(key=name, raw_value=value.encode()), append_action=OVERWRITE)


def routed(value: str, body: bytes | None, buffered: bool = False, prefiller: str = "") -> pb.ProcessingResponse:
    """The pick: the destination header (and the body's length when the body is sent back), the same value in
    `envoy.lb`, and the route recomputed with the header set; in P/D mode the prefill in `x-prefiller-host-port`
    (`prefiller`; a client's own header of that name is overwritten). FULL_DUPLEX_STREAMED (and a request without a
    body): the answer to the request's headers, the body following it (`body_back`); BUFFERED: the answer to the
    whole body, which carries it (`body`) only when it changed (None: unchanged)."""
    headers = [_header(DESTINATION, value)]
    if prefiller:
        headers.append(_header(PREFILLER, prefiller))
    if body is not None:
        headers.append(_header("content-length", str(len(body))))
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=headers), clear_route_cache=True)
    metadata = struct_pb2.Struct()
    metadata.fields[LB].struct_value.fields[DESTINATION].string_value = value
    if not buffered:
        return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata)
    if body is not None:
        common.body_mutation.body = body
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata)


def streamed(piece: bytes, end: bool, request: bool = True) -> pb.ProcessingResponse:
    """One piece of a body sent back to the gateway (FULL_DUPLEX_STREAMED: the gateway forwards what comes back),
    of the request's body or the response's; `end`: the last."""
    common = pb.CommonResponse(
        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(body=piece, end_of_stream=end))
    )
    if request:
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))
    return pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))


def body_back(body: bytes) -> list[pb.ProcessingResponse]:
    """A whole request body sent back, in pieces of at most CHUNK_BYTES, the last one ending the stream."""
    pieces = [body[i : i + CHUNK_BYTES] for i in range(0, len(body), CHUNK_BYTES)] or [b""]
    return [streamed(piece, i == len(pieces) - 1) for i, piece in enumerate(pieces)]


def refused(e: APIError) -> pb.ProcessingResponse:
    """A refusal: the gateway answers the client with `e`'s status, headers and OpenAI error body."""
    headers = [_header("content-type", "application/json")]
    headers += [_header(k.lower(), v) for k, v in e.headers().items()]
    immediate = pb.ImmediateResponse(
        body=json.dumps(e.body()).encode(),
        headers=pb.HeaderMutation(set_headers=headers),
        details=f"disagg_epp_{e.status}",
    )
    immediate.status.code = e.status  # type: ignore[assignment]  # an HTTP status is an envoy.type.v3.StatusCode
    return pb.ProcessingResponse(immediate_response=immediate)


def passed(kind: str) -> pb.ProcessingResponse:
    """The answer that lets a message of `kind` (one of `PASSED`) through unchanged."""
    if kind.endswith("trailers"):
        return pb.ProcessingResponse(**{kind: pb.TrailersResponse()})
    return pb.ProcessingResponse(**{kind: pb.HeadersResponse()})
