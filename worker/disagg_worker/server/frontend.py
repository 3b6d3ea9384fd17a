"""The HTTP process's side of the engine: send tokenized requests, turn token streams into text.

Path of a request: its endpoint (`endpoints/`) parses and validates it -> `Frontend.complete` tokenizes and
sends a GenerateReq over zmq to the scheduler process -> TokenOut messages come back on one PULL socket and
are routed to the request's queue -> detokenized incrementally, cut at stop strings -> streamed.
Tokenizing here keeps the scheduler process free of HTTP and text work: it only ever sees ids.
Long texts are tokenized (and chat templates rendered) on a thread, off the event loop, so a
multi-megabyte prompt cannot stall /health or other streams.

An instance with DP attention has one scheduler process per attention group: each request goes to one
of them (`groups.choose_group`), its aborts to the same one, and their reports are merged (`groups`).

The scheduler process is watched: when it exits, every request it held fails at once with a 500
coded `instance_failed` (the router does not retry those elsewhere: one of them may be what killed
it) and the instance refuses new ones with a 503 (`failed` says why); `fail_all` is also how a drain
that timed out ends the requests it still holds (503).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, TypeVar

import zmq
import zmq.asyncio

from disagg_worker.http.admission import RETRY_AFTER_S
from disagg_worker.mem.kv_events import EventLog
from disagg_worker.model.tokenizer import IncrementalDetokenizer, Tokenizer
from disagg_worker.request import messages as msg
from disagg_worker.request.errors import CODE_OF_STATUS, INSTANCE_FAILED, APIError, unavailable
from disagg_worker.request.limits import RequestLimits
from disagg_worker.request.params import SamplingParams, StopChecker
from disagg_worker.request.route import check_unrouted
from disagg_worker.server.groups import choose_group, group_problem, merge_stats
from disagg_worker.server.metrics import ServerMetrics
from disagg_worker.tracing import Tracer

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)
T = TypeVar("T")

# Texts (and bodies) up to this many characters are handled inline (about a millisecond): a thread hop
# would cost more than it saves. Longer ones go to the text thread.
INLINE_TEXT_CHARS = 2048


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
    # The prompt's logprobs (tokens 1..), with the first delta of a request that asked for them.
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


class Frontend:
    def __init__(
        self,
        tokenizer: Tokenizer,
        to_engine: str | list[str],
        from_engine: str,
        metrics: ServerMetrics,
        prefill: bool = False,
        kv_key_id: str = "",
        tracer: Tracer | None = None,
        routed: bool = False,
    ):
        """`to_engine`: the scheduler's inbox, or one per attention group (DP attention); `prefill`: this is a
        prefill instance (a request's group then follows its bootstrap target); `kv_key_id`: the id of the key
        naming the cached pages (`keys.kv_names`); `tracer`: with tracing on, what makes this process's spans;
        `routed`: a P/D worker, whose requests carry the router's routing fields (a monolithic server refuses them,
        `route.check_unrouted`)."""
        self.tokenizer = tokenizer
        self.routed = routed
        self.tracer = tracer
        self.metrics = metrics
        self.prefill = prefill
        self.ctx = zmq.asyncio.Context()
        self.pushes = []
        for addr in [to_engine] if isinstance(to_engine, str) else to_engine:
            push = self.ctx.socket(zmq.PUSH)
            push.connect(addr)
            self.pushes.append(push)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(from_engine)
        self.queues: dict[str, asyncio.Queue] = {}
        self.inflight = [0] * self.dp_size  # requests in flight per group
        self.infos: dict[int, msg.EngineInfo] = {}
        self.group_stats: dict[int, msg.SchedulerStats] = {}
        self.info: msg.EngineInfo | None = None
        # What every request is checked against: built from the scheduler's start-up report.
        self.limits = RequestLimits(max_context_len=1)
        self.stats: msg.SchedulerStats | None = None
        # The prefix caches' pages as routers index them (GET /kv_events); page size and model from the info.
        self.kv_log = EventLog(page_size=0, model="", key_id=kv_key_id)
        self.last_heartbeat = 0.0
        self.ready = asyncio.Event()
        # Why requests can no longer be served ("" while they can): the scheduler died, or a drain cut them.
        self.failed = ""
        self._task: asyncio.Task | None = None
        self._watched: list[BaseProcess] = []
        # HF `tokenizers` releases the GIL while it encodes, so this thread runs beside the loop.
        self._text_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._recv_loop())

    async def close(self) -> None:
        self.unwatch()
        if self._task:
            self._task.cancel()
        self._text_pool.shutdown(wait=False, cancel_futures=True)
        for push in self.pushes:
            push.close(0)
        self.pull.close(0)
        self.ctx.term()

    # ---- the scheduler process --------------------------------------------------------------
    def watch(self, procs: list[BaseProcess], on_exit: Callable[[str], None] = lambda reason: None) -> None:
        """Fail everything at once when any of `procs` (the instance's scheduler processes, one per
        rank) exits (its sentinel becomes readable); `on_exit` hears why. A rank alone cannot serve:
        its peers would wait for it in their next collective."""
        self._watched = list(procs)

        def exited(proc: BaseProcess) -> None:
            self.unwatch()
            proc.join(0)
            which = "scheduler process" if len(procs) == 1 else f"scheduler process {proc.name}"
            reason = (
                f"The {which} exited unexpectedly (exit code {proc.exitcode}); "
                "this instance cannot serve until it is restarted."
            )
            log.error("%s", reason)
            held = (
                f"{reason} The request it held is not retried on another instance: it may be what made this one fail."
            )
            self.fail_all(reason, held, 500, INSTANCE_FAILED)
            on_exit(reason)

        loop = asyncio.get_running_loop()
        for proc in procs:
            loop.add_reader(proc.sentinel, exited, proc)

    def unwatch(self) -> None:
        """The processes are about to be stopped on purpose: their exit is no failure."""
        loop = asyncio.get_running_loop()
        for proc in self._watched:
            loop.remove_reader(proc.sentinel)
        self._watched = []

    def fail_all(self, reason: str, held: str = "", status: int = 503, code: str = "") -> int:
        """Refuse new requests naming `reason`, and end every waiting one with `held` (default: `reason`),
        `status` and `code`; returns how many.

        Each stream then aborts its request in the scheduler, if that is still alive (`token_stream`).
        """
        self.failed = reason
        for rid, q in list(self.queues.items()):
            q.put_nowait(msg.TokenOut(rid, [], error=held or reason, error_status=status, error_code=code))
        return len(self.queues)

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
                self.kv_log.apply(m.dp_rank, m.kv_events)
                self.group_stats[m.dp_rank] = replace(m, kv_events=())
                self.stats = merge_stats(self.group_stats)
                self.metrics.observe_stats(self.stats)
            elif isinstance(m, msg.EngineInfo):
                self.infos[m.dp_rank] = m
                if len(self.infos) == self.dp_size:  # every group serves
                    self.info = self.infos[0]
                    self.limits = RequestLimits.from_info(self.info)
                    self.kv_log.page_size, self.kv_log.model = self.info.page_size, self.info.model_name
                    self.metrics.observe_info(self.info.page_size, sum(i.total_pages for i in self.infos.values()))
                    self.ready.set()

    @property
    def dp_size(self) -> int:
        """The instance's attention groups (1 without DP attention)."""
        return len(self.pushes)

    def healthy(self, timeout_s: float) -> bool:
        return not self.failed and self.ready.is_set() and time.monotonic() - self.last_heartbeat < timeout_s

    async def send(self, m: msg.Message, group: int = 0) -> None:
        if self._watched or not self.failed:  # nobody reads a dead scheduler's socket
            await self.pushes[group].send(msg.encode(m))

    async def send_all(self, m: msg.Message) -> None:
        """To every group's scheduler (a cache flush)."""
        for group in range(self.dp_size):
            await self.send(m, group)

    # ---- text -------------------------------------------------------------------------------
    async def parse(self, raw: bytes, parse: Callable[[bytes], T]) -> T:
        """A request body parsed by `parse`; a large one on the text thread (json.loads holds the GIL, but
        the loop gets its turn every switch interval instead of waiting for the whole body)."""
        return await self.off_loop(len(raw), parse, raw)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.off_loop(len(text), self.tokenizer.encode, text, add_special_tokens)

    async def render_chat(
        self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None
    ) -> str:
        chars = sum(len(m["content"]) for m in messages)
        render = self.tokenizer.apply_chat_template
        return await self.off_loop(chars, render, messages, add_generation_prompt, tools)

    async def off_loop(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` inline when `size` (characters or bytes) is small, else on the text thread."""
        if size <= INLINE_TEXT_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._text_pool, fn, *args)

    # ---- token streams --------------------------------------------------------------------
    async def token_stream(
        self, input_ids: list[int], params: SamplingParams, route: msg.Route = msg.NO_ROUTE
    ) -> AsyncGenerator[msg.TokenOut, None]:
        """Yield the engine's TokenOut messages for one request; aborts it if the consumer leaves."""
        if self.failed:
            raise unavailable(self.failed)
        if not self.routed:
            check_unrouted(route)
        field, problem = group_problem(route, self.dp_size, self.prefill)
        if problem:
            raise APIError(400, problem, param=field)
        group = choose_group(route, self.dp_size, self.inflight, self.prefill)
        rid = uuid.uuid4().hex
        q: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = q
        self.inflight[group] += 1
        done = False
        span = self.tracer.current() if self.tracer is not None else None  # a sampled request's server span
        try:
            req = msg.GenerateReq(
                rid,
                input_ids,
                params,
                route.bootstrap,
                route.local_prefill,
                route.local_sig,
                len(route.resume),
                traced=span is not None,
            )
            await self.send(req, group)
            while not done:
                out: msg.TokenOut = await q.get()
                done = out.finish_reason is not None
                if span is not None:
                    self._traced(span, out)
                if out.error:
                    raise APIError(
                        out.error_status or 500,
                        out.error,
                        type="invalid_request_error" if out.error_status < 500 else "server_error",
                        code=out.error_code or CODE_OF_STATUS.get(out.error_status),
                        retry_after=RETRY_AFTER_S if out.error_status == 503 else None,
                    )
                yield out
        finally:
            self.queues.pop(rid, None)
            self.inflight[group] -= 1
            if not done:
                await self.send(msg.AbortReq(rid), group)

    def _traced(self, span: Span, out: msg.TokenOut) -> None:
        """The scheduler's stages that ended, as spans under the request's `span`; its end, as attributes."""
        if self.tracer is not None:
            self.tracer.stages(span, out.stages)
        if out.finish_reason is not None:
            span.set_attribute("disagg.finish_reason", out.finish_reason)
            span.set_attribute("disagg.prompt_tokens", out.prompt_tokens)
            span.set_attribute("disagg.cached_tokens", out.cached_tokens)
        if out.error:
            span.set_attribute("disagg.error", out.error)

    def check_route(self, route: msg.Route, params: SamplingParams) -> None:
        """What a request's routing fields must be, checked before a stream's 200: none at a monolithic server
        (`route.check_unrouted`); a resume names tokens of the vocabulary, fewer than max_tokens: else a 400 naming
        resume_token_ids."""
        if not self.routed:
            check_unrouted(route)
        if not route.resume:
            return
        self.limits.check_token_ids(route.resume, "resume_token_ids")
        if len(route.resume) >= params.max_new_tokens:
            raise APIError(400, "resume_token_ids: as many tokens as max_tokens or more", param="resume_token_ids")

    def resume(
        self, route: msg.Route, params: SamplingParams, detok: IncrementalDetokenizer
    ) -> tuple[SamplingParams, str]:
        """A migrated request goes on from the tokens it generated elsewhere (`route.resume`): they count against
        max_tokens (the parameters returned), and the text of theirs the client lacks (what a stop string held
        back there) comes first (the text returned). `detok` has read them."""
        if not route.resume:
            return params, ""
        self.check_route(route, params)
        n = len(route.resume)
        held = "".join(detok.push(t) for t in route.resume)[route.resume_chars :]
        return replace(
            params, max_new_tokens=params.max_new_tokens - n, min_new_tokens=max(0, params.min_new_tokens - n)
        ), held

    async def complete(
        self,
        input_ids: list[int],
        params: SamplingParams,
        route: msg.Route = msg.NO_ROUTE,
        probe: bool = False,
    ) -> AsyncIterator[Delta]:
        """Text deltas of one choice, with stop strings applied and metrics observed (a router's probe apart)."""
        detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens)
        stopper = StopChecker(params.stop)
        timer = self.metrics.request_timer(len(input_ids), probe)
        resumed = len(route.resume)
        params, held = self.resume(route, params, detok)
        completion = resumed
        stream = self.token_stream(input_ids + list(route.resume), params, route)
        try:
            async for out in stream:
                text, hit, used = "", False, 0
                if held:
                    text, hit = stopper.push(held)
                    held = ""
                for tok in out.token_ids:
                    piece, hit = stopper.push(detok.push(tok))
                    text += piece
                    used += 1
                    if hit:
                        break
                # An output of several tokens (a verified speculative draft) ends at a stop string's token, as
                # one token at a time would: the tokens after it are neither counted nor returned.
                completion += used
                timer.tokens(used)
                finish = "stop" if hit else out.finish_reason
                if finish is not None and not hit:
                    piece, hit = stopper.push(detok.flush())
                    text += piece + ("" if hit else stopper.flush())
                yield Delta(
                    text,
                    list(out.token_ids[:used]),
                    (out.logprobs or [])[:used],
                    (out.top_logprobs or [])[:used],
                    finish,
                    max(0, out.prompt_tokens - resumed),
                    completion,
                    out.cached_tokens,
                    out.prompt_logprobs,
                    out.prompt_top_logprobs,
                )
                if finish is not None:
                    break
        finally:
            await stream.aclose()
            timer.finish()
