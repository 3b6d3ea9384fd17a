"""Runs one scheduled batch: the model forward over the paged KV cache, then sampling.

The forward is batch-wide: if it raises, the step fails and the instance with it. Sampling is each
request's own (its parameters, its grammar, its draft): when a batch's sampling raises, its requests
are sampled again one by one, and only those whose own sampling raises fail (`StepResult.failed`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from itertools import accumulate

import torch

from disagg_worker.disagg.layerwise import LayerStream
from disagg_worker.engine.batch import ScheduledBatch, StepResult
from disagg_worker.engine.cuda_graphs import DecodeGraphs
from disagg_worker.engine.drafting import ModelDrafter
from disagg_worker.engine.prompt_logprobs import split
from disagg_worker.engine.request import Req
from disagg_worker.engine.sampling import Sampler, SamplingState
from disagg_worker.engine.speculative import Emitted, verify
from disagg_worker.mem.kv_pool import KVPool
from disagg_worker.model.batch import ForwardBatch
from disagg_worker.model.decoder import CausalLM

log = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, the KV pool and the sampler; used from one thread at a time.

    Steps run strictly in submission order, so a step may take its input tokens from the step
    before it (`ScheduledBatch.future`) and page reuse is ordered: a page freed while a step is in
    flight is only written by a later step (the scheduler keeps a KV transfer or a load from host
    memory off it until that step is processed: `engine/in_flight.py`).

    The runner never writes a request's output list: the scheduler appends a token when it
    processes the step. With overlap, that may not have happened yet when the next step samples,
    so the runner completes the list with the token it sampled itself (at most one step behind).
    """

    def __init__(
        self,
        model: torch.nn.Module | None,
        kv_pool: KVPool,
        vocab_size: int,
        device: str = "cpu",
        drafter: ModelDrafter | None = None,
        layer_stream: LayerStream | None = None,
        graphs: DecodeGraphs | None = None,
    ):
        """`drafter`: the draft model of EAGLE or STANDALONE speculation (it fills in the planned drafts before
        each forward, follows what the target kept after it, and on prefill makes decode's hand-off).
        `layer_stream`: with a prefill's layer pipeline, this rank's `disagg.layerwise.LayerStream`, told of each
        layer computed. `graphs`: decode steps from static buffers (CUDA graphs), where they fit."""
        self.model = model
        self.drafter = drafter
        if drafter is not None and drafter.eagle and isinstance(model, CausalLM):
            model.keep_hidden = True  # the head reads the model's final hidden states
        self.kv_pool = kv_pool
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = Sampler(vocab_size, device=device)
        self._last: dict[int, int] = {}
        self._kv_written: torch.cuda.Event | None = None  # the last forward's, on a CUDA device
        self.layer_stream = layer_stream
        self.graphs = graphs

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepResult:
        fwd = batch.forward
        for j, req in batch.future:
            fwd.input_ids[j] = self._last[id(req)]
        if self.drafter is not None:
            self.drafter.fill(batch)
        return self.sample(batch, self.forward(fwd))

    @torch.inference_mode()
    def forward(self, fwd: ForwardBatch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's part of the forward: logits on the last stage, hidden states before it."""
        stream = self.layer_stream if self.layer_stream is not None and self.layer_stream.armed else None
        try:
            if self.model is None:  # no-op forward: measures everything but the model
                out = torch.zeros(fwd.num_logit_rows, self.vocab_size)
            elif stream is not None:  # each layer group's KV leaves as soon as it is computed
                out = self.model(fwd, self.kv_pool, hidden, after_layer=stream.layer_done)
            elif self.graphs is not None and hidden is None and self.graphs.fits(fwd):
                out = self.graphs.run(fwd)
            else:
                out = self.model(fwd, self.kv_pool, hidden)
        except BaseException:
            if stream is not None:
                stream.disarm()
            raise
        if stream is not None:
            stream.forward_done()
        if self.model is None:
            return out
        if self.kv_pool.device.type == "cuda":  # the KV this forward writes is there once the event is
            self._kv_written = torch.cuda.Event()
            self._kv_written.record()
        return out

    def wait_kv_written(self) -> None:
        """Block until the KV of the forwards run so far is in the pool (a device's kernels run after their launch:
        pages handed to the transfer before would send what is not written yet). Nothing to wait for on a CPU."""
        if self._kv_written is not None:
            self._kv_written.synchronize()

    @torch.inference_mode()
    def sample(self, batch: ScheduledBatch, logits: torch.Tensor) -> StepResult:
        """Sample the requests of `batch` that take a token from their rows of `logits`: one row each, or
        a drafted request's rows from its last known token on, verified (`speculative.verify`). A scored prompt
        chunk's rows are taken out first (`prompt_logprobs.split`)."""
        fwd = batch.forward
        if fwd.num_logits is not None and any(r.params.prompt_logprobs for r in batch.reqs):
            logits, counts, scores, failed = split(batch.reqs, fwd.extend_lens, fwd.seq_lens, fwd.num_logits, logits)
            batch.forward = replace(fwd, num_logits=counts)  # from here on, the rows sampling reads
            result = self._sample(batch, logits)
            result.prompt = scores
            result.failed |= failed  # those requests fail alone (`Scheduler.process`), the batch goes on
            return result
        return self._sample(batch, logits)

    def _sample(self, batch: ScheduledBatch, logits: torch.Tensor) -> StepResult:
        rows = [i for i, s in enumerate(batch.samples) if s]
        n = len(batch.reqs)
        result = StepResult(tokens=[-1] * n, logprobs=[None] * n, top_logprobs=[None] * n)
        outputs = [self._outputs_so_far(batch.reqs[i], batch.generated[i]) for i in rows]  # reads `_last`
        self._last = {}
        if not rows:
            if self.drafter is not None:
                self._follow(batch, result)
            return result
        first = [0, *accumulate(batch.forward.num_logits or [1] * n)]  # each request's first logits row
        starts, drafts = [first[i] for i in rows], [batch.draft(i) for i in rows]
        states = [batch.reqs[i].sampling for i in rows]
        try:
            emitted: Sequence[Emitted | None] = verify(self.sampler, logits, starts, states, outputs, drafts)
        except Exception:
            log.warning("sampling a batch of %d requests failed; sampling them one by one", len(rows), exc_info=True)
            rids = [batch.reqs[i].rid for i in rows]
            each = zip(rids, starts, states, outputs, drafts, strict=True)
            # A drafted request with a grammar may have advanced it in a round before the failure: it fails too.
            emitted = [
                None if row[4] and row[2].matcher is not None else self._verify_one(logits, *row) for row in each
            ]
        for i, e in zip(rows, emitted, strict=True):
            if e is None:
                result.failed.add(i)
                self._last[id(batch.reqs[i])] = 0  # a placeholder input for a step already scheduled with it
                continue
            result.tokens[i], result.logprobs[i], result.top_logprobs[i] = e.tokens[0], e.logprobs[0], e.tops[0]
            if len(e.tokens) > 1:
                result.extra[i] = list(zip(e.tokens[1:], e.logprobs[1:], e.tops[1:], strict=True))
            self._last[id(batch.reqs[i])] = e.tokens[-1]
        if self.drafter is not None:
            self._follow(batch, result)
        return result

    def _verify_one(
        self, logits: torch.Tensor, rid: str, start: int, state: SamplingState, outputs: list[int], draft: list[int]
    ) -> Emitted | None:
        """One request's sampling alone; None (logged) when it raises. A seeded request of a batch that failed
        may have drawn once already: its output is still valid, only not the one its seed alone would give."""
        try:
            return verify(self.sampler, logits, [start], [state], [outputs], [draft])[0]
        except Exception:
            log.exception("request %s: sampling failed", rid)
            return None

    def _follow(self, batch: ScheduledBatch, result: StepResult) -> None:
        """The draft model's part after a verified step: what the target kept, and a prefill's hand-off."""
        assert self.drafter is not None
        self.drafter.observe(batch, result, getattr(self.model, "hidden", None))
        for i, req in enumerate(batch.reqs):
            if req.handoff and batch.samples[i] and i not in result.failed:
                req.draft_aux = self.drafter.handoff(req, result.tokens[i])

    def _outputs_so_far(self, req: Req, generated: int) -> list[int]:
        """The `generated` output tokens of `req` before this step's sample."""
        known = req.output_ids[:generated]  # one atomic copy: the scheduler may append meanwhile
        if len(known) < generated:
            known.append(self._last[id(req)])
        return known
