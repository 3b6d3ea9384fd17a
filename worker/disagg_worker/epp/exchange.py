"""One request as the gateway streams it to the picker (one ext_proc `Process` stream), FULL_DUPLEX_STREAMED:

request headers (the path; the subset hint) -> body chunks, gathered within the body limit (413 past it) ->
at the body's end: the workers' parser checks it (its 4xx otherwise), cache_aware's prompt is named, the endpoint
picked, and in P/D mode the prefill (503, 429 otherwise) -> the answer to the headers (destination header +
`envoy.lb` metadata, in P/D mode `x-prefiller-host-port`, route recomputed) and the body streamed back (with
`data_parallel_rank` added under DP attention) -> the response's headers (which endpoint served: metrics; the
prompt is computed, the prefill's part is over) -> the stream ends (the request is closed on its endpoint). A
request without a body is picked at its headers. A gateway configured with request_body_mode BUFFERED (which
keeps the body, so that FailOpen can still send it on when the picker is gone) gets its headers answered at once
and the pick as the answer to the body. A message the picker does not expect is let through; whatever fails
inside the picker fails this request alone, with a 500.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from disagg_worker.epp import answers
from disagg_worker.epp.generated.envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from disagg_worker.epp.generated.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from disagg_worker.epp.metrics import EppMetrics
from disagg_worker.epp.pick import Choice, Picker
from disagg_worker.epp.request_body import CHECKS, HANDED_OFF, BodyBuffer, adapter_of, path_of, read_request, scored
from disagg_worker.request.errors import APIError, server_error
from disagg_worker.router.policies.prefix import Prompt
from disagg_worker.router.prompt import PromptTokens, prompt_of

log = logging.getLogger(__name__)
# The body mode in which the gateway holds the whole body and sends it in one message (the picker answers the
# headers first; the pick answers the body).
BUFFERED = (ProcessingMode.BUFFERED,)
# A body this large, or any body when prompts are tokenised, is read on a thread: the loop keeps answering the
# other streams (as the router does).
INLINE_BODY_BYTES = 64 * 1024


@dataclass(frozen=True)
class Reader:
    """What a request's body is read with: the served model's name (a body naming another is a 404, as a
    worker's), and cache_aware's tokenizer and page key (no tokenizer: no prompt read, picked by load)."""

    model: str
    prompts: PromptTokens | None = None
    kv_key: bytes = b""


@dataclass
class Exchange:
    picker: Picker
    reader: Reader
    metrics: EppMetrics
    path: str = ""
    subset: frozenset[str] | None = None
    buffer: BodyBuffer | None = None
    choice: Choice | None = None
    prefilled: bool = False
    # The gateway buffers the body and sends it whole (BUFFERED; its config says so in the first message): the
    # headers are answered at once and the pick answers the body. Otherwise FULL_DUPLEX_STREAMED.
    buffered: bool = False

    async def answer(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The answers to one message of the gateway's (none while a body is still coming)."""
        try:
            return await self._answer(req)
        except APIError as e:
            self.metrics.answered(e.status)
            return [answers.refused(e)]
        except Exception:  # noqa: BLE001 - the picker's own failure is this request's, not the stream server's
            log.exception("picking for %s failed", self.path or "a request")
            self.metrics.answered(500)
            return [answers.refused(server_error("The endpoint picker failed on this request."))]

    async def _answer(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            return self._headers(req)
        if kind == "request_body":
            return await self._body(req.request_body)
        if kind == "response_headers":
            self._answered(req)
        elif kind == "response_body":  # FULL_DUPLEX_STREAMED responses: each piece goes back as it came
            return [answers.streamed(req.response_body.body, req.response_body.end_of_stream, request=False)]
        return [answers.passed(kind)] if kind in answers.PASSED else []

    def _headers(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.path = path_of(answers.headers_of(req.request_headers.headers).get(":path", ""))
        self.subset = answers.subset_of(req)
        self.buffered = req.protocol_config.request_body_mode in BUFFERED
        if req.request_headers.end_of_stream:
            choice = self._pick(None, time.monotonic())
            return [answers.routed(choice.value, None, prefiller=choice.prefiller)]
        self.buffer = BodyBuffer(self.picker.body_limit())
        return [answers.passed("request_headers")] if self.buffered else []

    async def _body(self, chunk: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.buffer is None:  # a body after the pick (or without headers): it goes back as it came
            return [answers.streamed(chunk.body, chunk.end_of_stream)]
        self.buffer.add(chunk.body)
        if not chunk.end_of_stream:
            return []
        raw, self.buffer, since = self.buffer.bytes(), None, time.monotonic()
        if self.path not in CHECKS:
            return self._routed(self._pick(None, since), raw, changed=False)
        inline = len(raw) <= INLINE_BODY_BYTES and self.reader.prompts is None
        body, prompt = self._read(raw) if inline else await asyncio.to_thread(self._read, raw)
        choice = self._pick(prompt, since, adapter_of(self.path, body, self.reader.model))
        if choice.group is None:
            return self._routed(choice, raw, changed=False)
        # The attention group, named to the worker as the router names it.
        return self._routed(choice, json.dumps({**body, "data_parallel_rank": choice.group}).encode(), changed=True)

    def _routed(self, choice: Choice, raw: bytes, changed: bool) -> list[pb.ProcessingResponse]:
        if self.buffered:
            return [answers.routed(choice.value, raw if changed else None, True, choice.prefiller)]
        return [answers.routed(choice.value, raw, prefiller=choice.prefiller), *answers.body_back(raw)]

    def _read(self, raw: bytes) -> tuple[dict[str, Any], Prompt | None]:
        r = self.reader
        body = read_request(self.path, raw, r.model, self.picker.adapters())
        return body, prompt_of(r.prompts, self.picker.pool.kv_index, r.kv_key, *scored(self.path, body))

    def _pick(self, prompt: Prompt | None, since: float, adapter: str = "") -> Choice:
        """The endpoint, picked for `prompt` (under LoRA adapter `adapter`); the decision's time (since the whole
        request was in) measured."""
        self.choice = self.picker.choose(prompt, self.subset, handed_off=self.path in HANDED_OFF, adapter=adapter)
        self.metrics.picked(self.choice, time.monotonic() - since)
        return self.choice

    def _answered(self, req: pb.ProcessingRequest) -> None:
        """The response began: which endpoint served it (metrics), and its prompt is computed."""
        served = answers.served_of(req, answers.headers_of(req.response_headers.headers))
        if self.choice is not None:
            self.metrics.served(self.choice, served)
            if not self.prefilled:
                self.prefilled = True
                self.picker.prefilled(self.choice)

    def close(self) -> None:
        """The stream ended: the request is closed on its endpoint."""
        if self.choice is None:
            return
        if not self.prefilled:
            self.picker.prefilled(self.choice)
        self.picker.done(self.choice)
        self.choice = None
