"""The HTTP process's side of the engine: send tokenized requests, turn token streams into text.

Path of a request: api.py parses and validates it -> `Frontend.complete` tokenizes and sends a
GenerateReq over zmq to the scheduler process -> TokenOut messages come back on one PULL socket and
are routed to the request's queue -> detokenized incrementally, cut at stop strings -> streamed.
Tokenizing here keeps the scheduler process free of HTTP and text work: it only ever sees ids.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from disagg_worker import messages as msg
from disagg_worker.engine.params import SamplingParams, StopChecker
from disagg_worker.limits import RequestLimits
from disagg_worker.model.tokenizer import IncrementalDetokenizer, Tokenizer
from disagg_worker.server.errors import APIError
from disagg_worker.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


@dataclass
class Delta:
    """New output of one choice: text, token ids, and on the last one the finish reason."""

    text: str
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class Frontend:
    def __init__(self, tokenizer: Tokenizer, to_engine: str, from_engine: str, metrics: ServerMetrics):
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.ctx = zmq.asyncio.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(to_engine)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(from_engine)
        self.queues: dict[str, asyncio.Queue] = {}
        self.info: msg.EngineInfo | None = None
        # What every request is checked against: built from the scheduler's start-up report.
        self.limits = RequestLimits(max_context_len=1)
        self.stats: msg.SchedulerStats | None = None
        self.last_heartbeat = 0.0
        self.ready = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._recv_loop())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        self.push.close(0)
        self.pull.close(0)
        self.ctx.term()

    async def _recv_loop(self) -> None:
        while True:
            m = msg.decode(await self.pull.recv())
            self.last_heartbeat = time.monotonic()
            if isinstance(m, msg.BatchOut):
                for out in m.outputs:
                    q = self.queues.get(out.rid)
                    if q is not None:
                        q.put_nowait(out)
            elif isinstance(m, msg.SchedulerStats):
                self.stats = m
                self.metrics.observe_stats(m)
            elif isinstance(m, msg.EngineInfo):
                self.info = m
                self.limits = RequestLimits.from_info(m)
                self.ready.set()

    def healthy(self, timeout_s: float) -> bool:
        return self.ready.is_set() and time.monotonic() - self.last_heartbeat < timeout_s

    async def send(self, m: msg.Message) -> None:
        await self.push.send(msg.encode(m))

    # ---- token streams --------------------------------------------------------------------
    async def token_stream(
        self, input_ids: list[int], params: SamplingParams, bootstrap: msg.BootstrapInfo | None = None
    ) -> AsyncGenerator[msg.TokenOut, None]:
        """Yield the engine's TokenOut messages for one request; aborts it if the consumer leaves."""
        rid = uuid.uuid4().hex
        q: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = q
        done = False
        try:
            await self.send(msg.GenerateReq(rid, input_ids, params, bootstrap))
            while not done:
                out: msg.TokenOut = await q.get()
                done = out.finish_reason is not None
                if out.error:
                    raise APIError(
                        out.error_status or 500,
                        out.error,
                        type="invalid_request_error" if out.error_status < 500 else "server_error",
                    )
                yield out
        finally:
            self.queues.pop(rid, None)
            if not done:
                await self.send(msg.AbortReq(rid))

    async def complete(
        self, input_ids: list[int], params: SamplingParams, bootstrap: msg.BootstrapInfo | None = None
    ) -> AsyncIterator[Delta]:
        """Text deltas of one choice, with stop strings applied and metrics observed."""
        detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens)
        stopper = StopChecker(params.stop)
        timer = self.metrics.request_timer(len(input_ids))
        completion = 0
        stream = self.token_stream(input_ids, params, bootstrap)
        try:
            async for out in stream:
                completion += len(out.token_ids)
                timer.tokens(len(out.token_ids))
                text, hit = "", False
                for tok in out.token_ids:
                    piece, hit = stopper.push(detok.push(tok))
                    text += piece
                    if hit:
                        break
                finish = "stop" if hit else out.finish_reason
                if finish is not None and not hit:
                    piece, hit = stopper.push(detok.flush())
                    text += piece + ("" if hit else stopper.flush())
                yield Delta(
                    text,
                    list(out.token_ids),
                    out.logprobs or [],
                    out.top_logprobs or [],
                    finish,
                    out.prompt_tokens,
                    completion,
                    out.cached_tokens,
                )
                if finish is not None:
                    break
        finally:
            await stream.aclose()
            timer.finish()
