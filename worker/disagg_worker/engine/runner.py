"""Runs one scheduled batch: the model forward over the paged KV cache, then sampling."""

from __future__ import annotations

import torch

from disagg_worker.engine.batch import ScheduledBatch, StepResult
from disagg_worker.engine.request import Req
from disagg_worker.engine.sampling import Sampler
from disagg_worker.mem.kv_pool import KVPool
from disagg_worker.model.batch import ForwardBatch


class ModelRunner:
    """Owns the model, the KV pool and the sampler; used from one thread at a time.

    Steps run strictly in submission order, so a step may take its input tokens from the step
    before it (`ScheduledBatch.future`) and page reuse is ordered: a page freed while a step is in
    flight is only written by a later step.

    The runner never writes a request's output list: the scheduler appends a token when it
    processes the step. With overlap, that may not have happened yet when the next step samples,
    so the runner completes the list with the token it sampled itself (at most one step behind).
    """

    def __init__(self, model: torch.nn.Module | None, kv_pool: KVPool, vocab_size: int, device: str = "cpu"):
        self.model = model
        self.kv_pool = kv_pool
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = Sampler(vocab_size, device=device)
        self._last: dict[int, int] = {}

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepResult:
        fwd = batch.forward
        for j, req in batch.future:
            fwd.input_ids[j] = self._last[id(req)]
        return self.sample(batch, self.forward(fwd))

    @torch.inference_mode()
    def forward(self, fwd: ForwardBatch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's part of the forward: logits on the last stage, hidden states before it."""
        if self.model is None:  # no-op forward: measures everything but the model
            return torch.zeros(fwd.num_requests, self.vocab_size)
        return self.model(fwd, self.kv_pool, hidden)

    @torch.inference_mode()
    def sample(self, batch: ScheduledBatch, logits: torch.Tensor) -> StepResult:
        """Sample the requests of `batch` that take a token from their row of `logits`."""
        rows = [i for i, s in enumerate(batch.samples) if s]
        n = len(batch.reqs)
        tokens = [-1] * n
        logprobs: list[float | None] = [None] * n
        tops: list[list[tuple[int, float]] | None] = [None] * n
        outputs = [self._outputs_so_far(batch.reqs[i], batch.generated[i]) for i in rows]
        self._last = {}
        if rows:
            out = self.sampler.sample(logits[rows], [batch.reqs[i].sampling for i in rows], outputs)
            for k, i in enumerate(rows):
                tokens[i] = out.token_ids[k]
                self._last[id(batch.reqs[i])] = out.token_ids[k]
                if out.logprobs is not None:
                    logprobs[i] = out.logprobs[k]
                if out.top_logprobs is not None:
                    tops[i] = out.top_logprobs[k]
        return StepResult(tokens=tokens, logprobs=logprobs, top_logprobs=tops)

    def _outputs_so_far(self, req: Req, generated: int) -> list[int]:
        """The `generated` output tokens of `req` before this step's sample."""
        known = req.output_ids[:generated]  # one atomic copy: the scheduler may append meanwhile
        if len(known) < generated:
            known.append(self._last[id(req)])
        return known
