"""Decode steps from static buffers, one set per batch-size bucket, captured as CUDA graphs and replayed.

A decode step (one new token per request) is what a GPU runs most, and for a small batch its kernels are shorter
than the Python and the launches around them (Llama-3.1-8B's shape: 720 kernels a step on an H200, 1235 before
the fused ones; eager, 36 ms a step, replayed 5.5). So, as SGLang's and vLLM's graph runners do, the step's inputs
live in buffers fixed per bucket of batch sizes (token ids, positions, output slots, lengths, the page table), the
forward over them is captured once per bucket at start-up, and each step copies its batch into the buffers, padded
to its bucket, and replays the bucket's graph.

Padding rows decode token 0 at position 0 with a length of one into the padding page: a page of the pool after
the allocator's, never a request's, so they read and write nothing of anyone's. The attention plan reads the page
table: on CUDA the Triton kernels take it as it is (their split count fixed by the longest context; a short
request leaves splits empty), and the torch path (a CPU; MLA's attention) gathers the [bucket, context] slots the
table spans under a length mask.

Nothing in the captured region waits for the host: the plan is made from device tensors, every row's logits are
taken (a decode batch has one per request), the MoE counters add on the device, and MoE layers run their dense
path (`MoE.dense`: the routed one asks the host which experts were chosen). On a CPU the same static step runs
eagerly (tests compare it with the dynamic step); the CPU serving path does not use it.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch
from torch.nn.utils.rnn import pad_sequence

from disagg_worker.config import EngineConfig, Role
from disagg_worker.mem.allocator import pages_for
from disagg_worker.mem.kv_pool import KVKind, KVPool
from disagg_worker.model.attention import AttentionPlan
from disagg_worker.model.batch import ForwardBatch, empty_forward
from disagg_worker.model.decoder import CausalLM
from disagg_worker.model.moe import MoE

log = logging.getLogger(__name__)


def wanted(cfg: EngineConfig, model: torch.nn.Module | None, single_rank: bool, drafting: bool) -> bool:
    """Whether this instance captures its decode steps: on a CUDA device, unless --disable-cuda-graph, on one rank
    (collectives are not captured) without a draft model (its steps read the target's hidden states), unless it
    is a prefill instance (it decodes nothing), nor with LoRA adapters (a step's rows each select their own)."""
    on_cuda = torch.device(cfg.device).type == "cuda"
    decodes = cfg.disagg.role is not Role.PREFILL
    return (
        on_cuda
        and decodes
        and cfg.scheduler.cuda_graph
        and single_rank
        and not drafting
        and not cfg.lora.enabled
        and isinstance(model, CausalLM)
    )


def buckets(max_bs: int) -> tuple[int, ...]:
    """The batch sizes with a step of their own: 1, 2, 4, then every 8 below `max_bs`, and `max_bs`."""
    return tuple(b for b in (1, 2, 4) if b < max_bs) + tuple(range(8, max_bs, 8)) + (max_bs,)


@dataclass(frozen=True)
class StepBuffers:
    """A decode step's inputs, one row per request of the largest bucket; a bucket of `bs` uses rows 0..bs."""

    input_ids: torch.Tensor  # [max_bs] int64
    positions: torch.Tensor  # [max_bs] int64
    out_slots: torch.Tensor  # [max_bs] int64: where each new token's K/V goes
    seq_lens: torch.Tensor  # [max_bs] int32: keys per request, the new one included
    pages: torch.Tensor  # [max_bs, max_pages] int32: each request's pages, then the padding page

    @classmethod
    def zeros(cls, max_bs: int, max_pages: int, device: torch.device, pin: bool = False) -> StepBuffers:
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)

        ints = torch.int32
        return cls(
            zeros(max_bs), zeros(max_bs), zeros(max_bs), zeros(max_bs, dtype=ints), zeros(max_bs, max_pages, dtype=ints)
        )

    def copy_rows(self, src: StepBuffers, bs: int, cols: int) -> None:
        """Rows 0..bs (of the page table, its first `cols` columns) of `src` into these buffers (from pinned host
        memory: without waiting)."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(src, f.name)
            if mine.dim() == 2:
                mine, theirs = mine[:, :cols], theirs[:, :cols]
            mine[:bs].copy_(theirs[:bs], non_blocking=True)


def fill(buf: StepBuffers, fwd: ForwardBatch, bs: int, pad_page: int, page_size: int) -> int:
    """`fwd`'s requests into rows 0..n of `buf`, padding rows into n..bs; returns the page-table columns written
    (those of the longest request: the kernels read a row no further than its length, and what lies beyond in
    the torch path's gather, a page of an earlier step or the padding page, is masked)."""
    n = fwd.num_requests
    cols = pages_for(max(fwd.seq_lens, default=1), page_size)
    buf.input_ids[:n] = fwd.input_ids
    buf.positions[:n] = fwd.positions
    buf.out_slots[:n] = fwd.out_slots
    buf.seq_lens[:n] = torch.tensor(fwd.seq_lens, dtype=torch.int32)
    buf.input_ids[n:bs] = 0
    buf.positions[n:bs] = 0
    buf.out_slots[n:bs] = pad_page * page_size
    buf.seq_lens[n:bs] = 1
    buf.pages[n:bs, :cols] = pad_page
    if n:  # a sequence starts each page at offset 0: its pages are its slots at 0, page_size, ... over page_size
        firsts = pad_sequence([slots[::page_size] for slots in fwd.kv_slots], batch_first=True, padding_value=-1)
        buf.pages[:n, :cols] = torch.where(firsts < 0, pad_page, firsts // page_size)
    return cols


def static_plan(buf: StepBuffers, bs: int, page_size: int, torch_index: bool, kernels: bool) -> AttentionPlan:
    """The attention plan of a bucket, from the device buffers alone (capturable: no host value read).
    `torch_index`: the slots and mask the torch path gathers by; `kernels`: the Triton kernels' page tables."""
    pages, lens = buf.pages[:bs], buf.seq_lens[:bs]
    index = mask = None
    if torch_index:
        offsets = torch.arange(page_size, device=pages.device)
        index = (pages.long()[:, :, None] * page_size + offsets).view(bs, -1)
        keys = torch.arange(index.shape[1], device=pages.device)
        mask = (keys[None, :] < lens[:, None])[:, None, None, :]
    tables = None
    if kernels:
        from disagg_worker.model.triton_attention import PageTables

        ones = torch.ones(bs, dtype=torch.int32, device=pages.device)
        starts = torch.arange(bs, dtype=torch.int32, device=pages.device)
        tables = PageTables(pages, lens, starts, ones, max_seq_len=pages.shape[1] * page_size, max_q_len=1)
    return AttentionPlan(buf.out_slots[:bs], index, mask, (), tables)


@contextmanager
def dense_experts(model: torch.nn.Module) -> Iterator[None]:
    """MoE layers on their host-free path for the duration."""
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    for m in moes:
        m.dense = True
    try:
        yield
    finally:
        for m in moes:
            m.dense = False


def captured(
    model: torch.nn.Module | None, pool: KVPool, pad_page: int, cfg: EngineConfig, max_context_len: int
) -> DecodeGraphs:
    """The instance's decode steps, captured (`wanted` said yes)."""
    assert isinstance(model, CausalLM)
    graphs = DecodeGraphs(
        model, pool, pad_page, min(cfg.scheduler.cuda_graph_max_bs, cfg.scheduler.max_running_requests), max_context_len
    )
    start = time.monotonic()
    graphs.capture()
    log.info(
        "decode steps captured as CUDA graphs for batch sizes %s in %.1f s", graphs.sizes, time.monotonic() - start
    )
    return graphs


class DecodeGraphs:
    """The static decode step of a single-stage model, per bucket of batch sizes up to `max_bs`, for requests
    of at most `max_context_len` tokens; `capture` records each bucket's as a CUDA graph (a CPU runs them eagerly).
    `pad_page` is a page of `pool` no request is given."""

    def __init__(self, model: CausalLM, pool: KVPool, pad_page: int, max_bs: int, max_context_len: int):
        self.model, self.pool, self.pad_page = model, pool, pad_page
        self.page_size = pool.page_size
        self.max_context_len = max_context_len
        self.sizes = buckets(max_bs)
        device = pool.device
        self.on_cuda = device.type == "cuda"
        max_pages = pages_for(max_context_len, self.page_size)
        self.buffers = StepBuffers.zeros(max_bs, max_pages, device)
        # On CUDA a step fills pinned host buffers, then copies them over without waiting.
        self.host = (
            StepBuffers.zeros(max_bs, max_pages, torch.device("cpu"), pin=True) if self.on_cuda else self.buffers
        )
        self.copied: torch.cuda.Event | None = None  # the last step's copy out of `host`
        self.torch_index = not self.on_cuda or pool.kind is KVKind.MLA
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0

    def fits(self, fwd: ForwardBatch) -> bool:
        """A decode batch of a bucket's size at most, one logits row per request, within the longest context."""
        return (
            fwd.is_decode
            and fwd.num_logits is None
            and 0 < fwd.num_requests <= self.sizes[-1]
            and max(fwd.seq_lens) <= self.max_context_len
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Record every bucket's step, largest first, in one memory pool (the smaller ones reuse its blocks)."""
        mempool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):
            self._load(empty_forward(), bs)  # padding rows only
            for _ in range(2):  # Triton compiles its kernels, cuBLAS picks its algorithms: neither in a capture
                self._step(bs)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                self.outputs[bs] = self._step(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def run(self, fwd: ForwardBatch) -> torch.Tensor:
        """float32 logits [n, vocab] of a batch that `fits`; a captured bucket's are its output buffer's rows,
        valid until the next step."""
        n = fwd.num_requests
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        self._load(fwd, bs)
        graph = self.graphs.get(bs)
        if graph is None:
            return self._step(bs)[:n]
        graph.replay()
        self.replays += 1
        return self.outputs[bs][:n]

    def _load(self, fwd: ForwardBatch, bs: int) -> None:
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copy has read the host buffers
        cols = fill(self.host, fwd, bs, self.pad_page, self.page_size)
        if self.host is not self.buffers:
            self.buffers.copy_rows(self.host, bs, cols)
            self.copied = torch.cuda.Event()
            self.copied.record()

    def _step(self, bs: int) -> torch.Tensor:
        plan = static_plan(self.buffers, bs, self.page_size, self.torch_index, kernels=self.on_cuda)
        with dense_experts(self.model):
            return self.model.decode_logits(self.buffers.input_ids[:bs], self.buffers.positions[:bs], plan, self.pool)
