"""Turning a batch of next-token logits into tokens.

Each request owns one `SamplingState` (params, prompt, its output list, the seeded generator);
the model runner calls `Sampler.sample(logits, states, outputs)` once per forward with one logits
row per request that samples. Per row, in this order:

1. penalties: repetition (HF/vLLM style, over prompt + output tokens), then frequency and
   presence (OpenAI style, over output tokens only), then the request's logit_bias;
2. greedy rows (temperature ~ 0) take the argmax and use no randomness at all;
3. the other rows are divided by their temperature, filtered by top-k, top-p (on the top-k
   renormalised distribution) and min-p, and sampled with an exponential race
   (argmax of p / Exp(1) noise), which draws exactly `vocab_size` numbers per row and step.

Every step works row by row, so a request with a seed sees the same tokens whatever else is in
the batch: its noise comes from its own `torch.Generator`; unseeded rows share the sampler's
default generator. EOS and stop token ids are the request's concern (`Req.append_token`); stop
strings are cut on the text side (`params.StopChecker`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from disagg_worker.engine.grammar import accept_rows, mask_rows
from disagg_worker.request.params import (  # noqa: F401 - re-exported for the engine
    GREEDY_EPS,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    TOP_P_CANDIDATES,
    SamplingParams,
    StopChecker,
)


@dataclass
class SamplingState:
    """Per-request sampling state, owned by the request.

    `output_ids` is the request's own output list (shared, not copied; the scheduler appends to
    it). `create` makes the generator from `params.seed`, on `device` (the sampler moves its draws
    where needed).
    """

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None
    # Draws from `generator` made by another instance for this request (decode goes on with a request
    # whose first token prefill sampled): the sampler makes and discards as many before its next draw,
    # so a seeded request samples the same tokens through prefill + decode as on one instance.
    draws_elsewhere: int = 0
    # A migrated request's last `resumed` prompt tokens are ones it generated on the instance that failed: the
    # frequency and presence penalties count them as output (`apply_penalties`).
    resumed: int = 0
    # The request's grammar (an xgrammar GrammarMatcher) when it asked for structured output.
    matcher: Any = None
    # Prompt ids as a tensor, built on first use by the repetition penalty (prompts never change).
    _prompt_tensor: torch.Tensor | None = field(default=None, init=False, repr=False)

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_ids: list[int],
        output_ids: list[int] | None = None,
        device: str | torch.device = "cpu",
    ) -> SamplingState:
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(params.seed % 2**64)
        outputs = [] if output_ids is None else output_ids
        return cls(params=params, prompt_ids=list(prompt_ids), output_ids=outputs, generator=gen)

    def resume_after(self, first_token: int) -> None:
        """Go on with a request whose first token another instance sampled (decode after prefill): skip
        that instance's draw, and move the grammar past the token."""
        self.skip([first_token])

    def skip(self, tokens: list[int]) -> None:
        """Go on after `tokens` sampled elsewhere, one draw each (decode after prefill; a request migrated from
        an instance that failed): a seeded request draws next what it would have drawn after them, and its
        grammar stands past them."""
        self.draws_elsewhere += len(tokens)
        if self.matcher is not None:
            for token in tokens:
                accept_rows([self.matcher], [token])

    @property
    def resumed_ids(self) -> list[int]:
        """The tokens a migrated request generated before it moved here (the end of its prompt)."""
        return self.prompt_ids[len(self.prompt_ids) - self.resumed :] if self.resumed else []

    def prompt_tensor(self, device: torch.device) -> torch.Tensor:
        if self._prompt_tensor is None or self._prompt_tensor.device != device:
            self._prompt_tensor = torch.tensor(self.prompt_ids, dtype=torch.long, device=device)
        return self._prompt_tensor


@dataclass
class SampleOutput:
    """One entry per request of the batch, in batch order.

    `logprobs` are raw model logprobs: log_softmax of the logits as the model returned them,
    before penalties, temperature and filtering. Both lists are None when no request of the
    batch asked for logprobs; otherwise every row has its chosen token's logprob, and
    `top_logprobs[i]` holds `params.logprobs` (token, logprob) pairs, best first (empty for
    rows that asked for none).
    """

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


def _column(reqs: Sequence[SamplingState], name: str, device: torch.device) -> torch.Tensor:
    vals = [float(getattr(r.params, name)) for r in reqs]
    return torch.tensor(vals, dtype=torch.float32, device=device).unsqueeze(1)


def _flat_ids(rows: list[torch.Tensor], vocab: int) -> torch.Tensor:
    """Flattened (row * vocab + token) indices of all valid token ids of all rows."""
    parts = []
    for i, ids in enumerate(rows):
        ids = ids[(ids >= 0) & (ids < vocab)]
        parts.append(ids + i * vocab)
    return torch.cat(parts)


def apply_penalties(
    logits: torch.Tensor, reqs: Sequence[SamplingState], outputs: Sequence[Sequence[int]] | None = None
) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens, then frequency/presence over output tokens.

    `outputs[i]` are row i's output tokens so far (default: `reqs[i].output_ids`). Only the
    entries of tokens that occurred are touched; `logits` itself is not modified.
    """
    rep = any(r.params.repetition_penalty != 1.0 for r in reqs)
    freq = any(r.params.frequency_penalty or r.params.presence_penalty for r in reqs)
    if not (rep or freq):
        return logits
    vocab, dev = logits.shape[1], logits.device
    flat = logits.clone().view(-1)
    so_far = [r.output_ids for r in reqs] if outputs is None else outputs
    so_far = [
        [*r.prompt_ids[len(r.prompt_ids) - r.resumed :], *o] if r.resumed else o
        for r, o in zip(reqs, so_far, strict=True)
    ]
    out_ids = [torch.tensor(list(o), dtype=torch.long, device=dev) for o in so_far]
    if rep:
        seen = [torch.cat([r.prompt_tensor(dev), out]) for r, out in zip(reqs, out_ids, strict=True)]
        idx = torch.unique(_flat_ids(seen, vocab))
        pen = _column(reqs, "repetition_penalty", dev).squeeze(1)[idx // vocab]
        vals = flat[idx]
        flat[idx] = torch.where(vals > 0, vals / pen, vals * pen)
    if freq:
        idx, counts = torch.unique(_flat_ids(out_ids, vocab), return_counts=True)
        rows = idx // vocab
        freq_pen = _column(reqs, "frequency_penalty", dev).squeeze(1)[rows]
        pres_pen = _column(reqs, "presence_penalty", dev).squeeze(1)[rows]
        flat[idx] -= freq_pen * counts.to(flat.dtype) + pres_pen
    return flat.view_as(logits)


def apply_logit_bias(logits: torch.Tensor, reqs: Sequence[SamplingState]) -> torch.Tensor:
    """`logits` with each row's `logit_bias` values added to their tokens (a copy when any row has a bias)."""
    rows = [(i, r.params.logit_bias) for i, r in enumerate(reqs) if r.params.logit_bias]
    if not rows:
        return logits
    vocab, out = logits.shape[1], logits.clone()
    for i, bias in rows:
        kept = [(t, b) for t, b in bias if t < vocab]
        ids = torch.tensor([t for t, _ in kept], dtype=torch.long, device=out.device)
        out[i, ids] += torch.tensor([b for _, b in kept], dtype=out.dtype, device=out.device)
    return out


def filter_mask(logits: torch.Tensor, reqs: Sequence[SamplingState]) -> torch.Tensor:
    """True where min-p, top-k or top-p removes a token. `logits` are temperature-scaled."""
    vocab = logits.shape[1]
    mask = torch.zeros_like(logits, dtype=torch.bool)
    if any(r.params.min_p > 0 for r in reqs):
        probs = torch.softmax(logits, dim=-1)
        max_p = probs.max(dim=-1, keepdim=True).values
        mask = probs < _column(reqs, "min_p", logits.device) * max_p
    rows = [i for i, r in enumerate(reqs) if 0 < r.params.top_k < vocab or r.params.top_p < 1]
    if rows:
        sub = [reqs[i] for i in rows]
        idx = torch.tensor(rows, device=logits.device)
        mask[idx] |= _top_k_top_p_mask(logits[idx], sub)
    return mask


def _top_k_top_p_mask(logits: torch.Tensor, reqs: Sequence[SamplingState]) -> torch.Tensor:
    """Top-k, then top-p on the renormalised top-k distribution.

    A full sort of the vocabulary is slow, so the decision is made on the best
    TOP_P_CANDIDATES tokens and only rows whose cut-off lies beyond them are sorted in full.
    """
    vocab, dev = logits.shape[1], logits.device
    ks = torch.tensor([min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in reqs], device=dev)
    ps = _column(reqs, "top_p", dev)
    active_k = [k for k in ks.tolist() if k < vocab]
    cand = min(vocab, max([TOP_P_CANDIDATES, *active_k]))
    vals, order = logits.topk(cand, dim=-1)
    drop, exact = _sorted_drop(vals, logits, ks.unsqueeze(1), ps)
    mask = torch.ones_like(logits, dtype=torch.bool).scatter_(1, order, drop)
    if cand < vocab and not bool(exact.all()):
        bad = (~exact).nonzero().squeeze(1)
        vals, order = logits[bad].sort(dim=-1, descending=True)
        drop, _ = _sorted_drop(vals, logits[bad], ks[bad].unsqueeze(1), ps[bad])
        mask[bad] = torch.empty_like(drop).scatter_(1, order, drop)
    return mask


def _sorted_drop(vals, logits, ks, ps) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop mask over the best-first candidate logits `vals`, and per row whether it is exact.

    A row is exact when its kept set lies within the candidates: top-k applies within them, or
    top-k is off and the candidates' mass already exceeds top-p.
    """
    cand, vocab = vals.shape[1], logits.shape[1]
    ranks = torch.arange(cand, device=vals.device).unsqueeze(0)
    drop = ranks >= ks
    kept = vals.masked_fill(drop, -math.inf)
    norm = kept.logsumexp(-1, True)
    if bool((ks > cand).any()):
        norm = torch.where(ks <= cand, norm, logits.logsumexp(-1, True))
    probs = (kept - norm).exp()
    mass = probs.cumsum(dim=-1)
    # Keep the smallest best-first set whose mass reaches top_p (the best token always stays).
    drop |= (mass - probs) >= ps
    exact = (ks <= cand) | ((ks >= vocab) & (mass[:, -1:] > ps))
    return drop, exact.squeeze(1)


class Sampler:
    """Samples one token per request from a batch of logits; stateless apart from the shared
    generator that requests without a seed draw from (seeded with `seed`)."""

    def __init__(self, vocab_size: int, device: str | torch.device = "cpu", seed: int = 0):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._default = torch.Generator(device=self.device)
        self._default.manual_seed(seed)

    def sample(
        self,
        logits: torch.Tensor,
        reqs: Sequence[SamplingState],
        outputs: Sequence[Sequence[int]] | None = None,
    ) -> SampleOutput:
        """Pick one token per row of `logits` [B, >= vocab_size]; row i belongs to `reqs[i]`,
        whose output tokens so far are `outputs[i]` (default: `reqs[i].output_ids`)."""
        if logits.shape[0] != len(reqs):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(reqs)} requests")
        raw = logits[:, : self.vocab_size].float()
        matchers = [r.matcher for r in reqs]
        processed = mask_rows(apply_logit_bias(apply_penalties(raw, reqs, outputs), reqs), matchers)
        tokens = processed.argmax(dim=-1)
        rows = [i for i, r in enumerate(reqs) if not r.params.is_greedy]
        if rows:
            sub = [reqs[i] for i in rows]
            idx = torch.tensor(rows, device=raw.device)
            tokens[idx] = self._draw(processed[idx] / _column(sub, "temperature", raw.device), sub)
        token_ids = tokens.tolist()
        logprobs, top = self._logprobs(raw, tokens, reqs)
        accept_rows(matchers, token_ids)  # last: a sample that raises before it leaves every grammar where it was
        return SampleOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top)

    def _draw(self, scaled: torch.Tensor, reqs: Sequence[SamplingState]) -> torch.Tensor:
        scaled = scaled.masked_fill(filter_mask(scaled, reqs), -math.inf)
        probs = torch.softmax(scaled, dim=-1)
        for r in reqs:
            _catch_up(r, probs.shape[1])
        noise = self._noise(probs.shape, [r.generator for r in reqs], probs.device)
        return (probs / noise).argmax(dim=-1)

    def _noise(self, shape: torch.Size, gens: list, device: torch.device) -> torch.Tensor:
        """Exp(1) noise, row i drawn from gens[i] (or the shared generator when it is None)."""
        noise = torch.empty(shape, device=device)
        shared = [i for i, g in enumerate(gens) if g is None]
        if shared:
            draw = torch.empty((len(shared), shape[1]), device=self._default.device)
            draw.exponential_(generator=self._default)
            noise[torch.tensor(shared, device=device)] = draw.to(device)
        for i, g in enumerate(gens):
            if g is not None:
                draw = torch.empty(shape[1], device=g.device).exponential_(generator=g)
                noise[i] = draw.to(device)
        return noise.clamp_(min=torch.finfo(noise.dtype).tiny)

    def _logprobs(self, raw: torch.Tensor, tokens: torch.Tensor, reqs: Sequence[SamplingState]):
        wanted = [r.params.logprobs for r in reqs]
        if all(w is None for w in wanted):
            return None, None
        lsm = torch.log_softmax(raw, dim=-1)
        chosen = lsm.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        n_top = min(max(w or 0 for w in wanted), raw.shape[1])
        top: list[list[tuple[int, float]]] = [[] for _ in reqs]
        if n_top > 0:
            best = lsm.topk(n_top, dim=-1)
            vals, ids = best.values.tolist(), best.indices.tolist()
            for i, w in enumerate(wanted):
                top[i] = list(zip(ids[i][: w or 0], vals[i][: w or 0], strict=True))
        return chosen, top


def _catch_up(state: SamplingState, width: int) -> None:
    """Advance a seeded generator past the draws another instance made (`draws_elsewhere`), each
    as `Sampler._noise` makes it: `width` exponential samples."""
    gen = state.generator
    while state.draws_elsewhere > 0 and gen is not None:
        torch.empty(width, device=gen.device).exponential_(generator=gen)
        state.draws_elsewhere -= 1
