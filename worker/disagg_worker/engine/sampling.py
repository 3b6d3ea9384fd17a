"""Turning a batch of next-token logits into tokens, and cutting text at stop strings.

The scheduler owns one `SamplingState` per request (params, prompt, tokens so far, the seeded
generator) and calls `Sampler.sample(logits, states)` once per forward with one logits row per
request. Per row, in this order:

1. penalties: repetition (HF/vLLM style, over prompt + output tokens), then frequency and
   presence (OpenAI style, over output tokens only);
2. greedy rows (temperature ~ 0) take the argmax and use no randomness at all;
3. the other rows are divided by their temperature, filtered by top-k, top-p (on the top-k
   renormalised distribution) and min-p, and sampled with an exponential race
   (argmax of p / Exp(1) noise), which draws exactly `vocab_size` numbers per row and step.

Every step works row by row, so a request with a seed sees the same tokens whatever else is in
the batch: its noise comes from its own `torch.Generator`; unseeded rows share the sampler's
default generator. EOS handling and stop checks are the scheduler's and detokenizer's job;
`StopChecker` below is the text-side helper for stop strings.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Sequence

import torch

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
# Temperatures below this are treated as greedy (dividing by them would overflow).
GREEDY_EPS = 1e-5
# Best tokens considered by top-k/top-p before falling back to sorting the whole vocabulary.
TOP_P_CANDIDATES = 1024
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0  # < GREEDY_EPS -> greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 -> disabled
    min_p: float = 0.0
    # Same seed + same prompt -> same output, whatever the batch composition.
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_new_tokens: int = 0
    # None: no logprobs; 0: the chosen token's; N: plus the top-N alternatives.
    logprobs: int | None = None
    skip_special_tokens: bool = True

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def validate(self) -> None:
        """Raise ValueError("<field>: <what is wrong>") for the first out-of-range field."""
        for f in fields(self):
            problem = _CHECKS[f.name](getattr(self, f.name))
            if problem:
                raise ValueError(f"{f.name}: {problem}")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                "min_new_tokens: must not exceed the maximum number of new tokens "
                f"({self.max_new_tokens}), got {_fmt(self.min_new_tokens)}"
            )


def _fmt(v: object) -> str:
    if _is_int(v) and abs(v) >= 10**40:
        return "a huge integer"
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _int_range(lo: int | None, hi: int | None, optional: bool = False):
    def check(v: object) -> str | None:
        if v is None and optional:
            return None
        if not _is_int(v):
            return f"must be an integer, got {_fmt(v)}"
        if lo is not None and v < lo:
            return f"must be >= {lo}, got {_fmt(v)}"
        if hi is not None and v > hi:
            return f"must be <= {hi}, got {_fmt(v)}"
        return None

    return check


def _real_range(lo: float, hi: float, lo_open: bool = False):
    def check(v: object) -> str | None:
        if not _is_real(v):
            return f"must be a finite number, got {_fmt(v)}"
        if v < lo or (lo_open and v == lo):
            return f"must be {'>' if lo_open else '>='} {lo}, got {_fmt(v)}"
        if v > hi:
            return f"must be <= {hi}, got {_fmt(v)}"
        return None

    return check


def _check_bool(v: object) -> str | None:
    return None if isinstance(v, bool) else f"must be a boolean, got {_fmt(v)}"


def _check_stop(v: object) -> str | None:
    if not isinstance(v, tuple) or not all(isinstance(s, str) and s for s in v):
        return "must be a tuple of non-empty strings"
    if len(v) > MAX_STOP_STRINGS:
        return f"at most {MAX_STOP_STRINGS} stop strings, got {len(v)}"
    return None


def _check_stop_ids(v: object) -> str | None:
    if not isinstance(v, tuple) or not all(_is_int(t) and 0 <= t < 2**31 for t in v):
        return "must be a tuple of non-negative token ids"
    return None


def _check_top_k(v: object) -> str | None:
    if not _is_int(v) or v < -1:
        return f"must be -1 (disabled), 0 (disabled) or a positive integer, got {_fmt(v)}"
    return None


_CHECKS = {
    "max_new_tokens": _int_range(1, None),
    "temperature": _real_range(0.0, 2.0),
    "top_p": _real_range(0.0, 1.0, lo_open=True),
    "top_k": _check_top_k,
    "min_p": _real_range(0.0, 1.0),
    "seed": _int_range(_SEED_MIN, _SEED_MAX, optional=True),
    "frequency_penalty": _real_range(-2.0, 2.0),
    "presence_penalty": _real_range(-2.0, 2.0),
    "repetition_penalty": _real_range(0.0, math.inf, lo_open=True),
    "stop": _check_stop,
    "stop_token_ids": _check_stop_ids,
    "ignore_eos": _check_bool,
    "min_new_tokens": _int_range(0, None),
    "logprobs": _int_range(0, MAX_LOGPROBS, optional=True),
    "skip_special_tokens": _check_bool,
}


@dataclass
class SamplingState:
    """Per-request sampling state, owned by the request.

    The sampler reads `output_ids`; the scheduler appends to it after each step. `create` makes
    the generator from `params.seed`, on `device` (the sampler moves its draws where needed).
    """

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None
    # Prompt ids as a tensor, built on first use by the repetition penalty (prompts never change).
    _prompt_tensor: torch.Tensor | None = field(default=None, init=False, repr=False)

    @classmethod
    def create(
        cls, params: SamplingParams, prompt_ids: list[int], device: str | torch.device = "cpu"
    ) -> SamplingState:
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(params.seed % 2**64)
        return cls(params=params, prompt_ids=list(prompt_ids), output_ids=[], generator=gen)

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


def apply_penalties(logits: torch.Tensor, reqs: Sequence[SamplingState]) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens, then frequency/presence over output tokens.

    Only the entries of tokens that occurred are touched; `logits` itself is not modified.
    """
    rep = any(r.params.repetition_penalty != 1.0 for r in reqs)
    freq = any(r.params.frequency_penalty or r.params.presence_penalty for r in reqs)
    if not (rep or freq):
        return logits
    vocab, dev = logits.shape[1], logits.device
    flat = logits.clone().view(-1)
    outputs = [torch.tensor(r.output_ids, dtype=torch.long, device=dev) for r in reqs]
    if rep:
        seen = [torch.cat([r.prompt_tensor(dev), out]) for r, out in zip(reqs, outputs)]
        idx = torch.unique(_flat_ids(seen, vocab))
        pen = _column(reqs, "repetition_penalty", dev).squeeze(1)[idx // vocab]
        vals = flat[idx]
        flat[idx] = torch.where(vals > 0, vals / pen, vals * pen)
    if freq:
        idx, counts = torch.unique(_flat_ids(outputs, vocab), return_counts=True)
        rows = idx // vocab
        freq_pen = _column(reqs, "frequency_penalty", dev).squeeze(1)[rows]
        pres_pen = _column(reqs, "presence_penalty", dev).squeeze(1)[rows]
        flat[idx] -= freq_pen * counts.to(flat.dtype) + pres_pen
    return flat.view_as(logits)


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
    ks = torch.tensor([r.params.top_k if r.params.top_k > 0 else vocab for r in reqs], device=dev)
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

    def sample(self, logits: torch.Tensor, reqs: Sequence[SamplingState]) -> SampleOutput:
        """Pick one token per row of `logits` [B, >= vocab_size]; row i belongs to `reqs[i]`."""
        if logits.shape[0] != len(reqs):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(reqs)} requests")
        raw = logits[:, : self.vocab_size].float()
        processed = apply_penalties(raw, reqs)
        tokens = processed.argmax(dim=-1)
        rows = [i for i, r in enumerate(reqs) if not r.params.is_greedy]
        if rows:
            sub = [reqs[i] for i in rows]
            idx = torch.tensor(rows, device=raw.device)
            tokens[idx] = self._draw(processed[idx] / _column(sub, "temperature", raw.device), sub)
        token_ids = tokens.tolist()
        logprobs, top = self._logprobs(raw, tokens, reqs)
        return SampleOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=top)

    def _draw(self, scaled: torch.Tensor, reqs: Sequence[SamplingState]) -> torch.Tensor:
        scaled = scaled.masked_fill(filter_mask(scaled, reqs), -math.inf)
        probs = torch.softmax(scaled, dim=-1)
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
            vals, ids = lsm.topk(n_top, dim=-1)
            vals, ids = vals.tolist(), ids.tolist()
            for i, w in enumerate(wanted):
                top[i] = list(zip(ids[i][: w or 0], vals[i][: w or 0]))
        return chosen, top


class StopChecker:
    """Cuts streamed text at the stop string that completes first.

    "First" means the earliest end (the longest string when several end together), so the result
    does not depend on how the text is split into deltas.

    `push(delta)` returns the text that is safe to emit now and whether a stop string was hit.
    Text that could be the start of a stop string is held back until the next delta decides;
    `flush()` returns it at the end of the stream. After a hit, nothing more is emitted and the
    stop string itself is never emitted.
    """

    def __init__(self, stop: tuple[str, ...]):
        if any(not s for s in stop):
            raise ValueError("stop: stop strings must be non-empty")
        self._stop = tuple(stop)
        self._held = ""
        self._hit = False

    @property
    def stopped(self) -> bool:
        return self._hit

    def push(self, delta: str) -> tuple[str, bool]:
        if self._hit:
            return "", True
        text = self._held + delta
        hits = [(i + len(s), i) for s in self._stop if (i := text.find(s)) >= 0]
        if hits:
            self._hit, self._held = True, ""
            return text[: min(hits)[1]], True
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if s.startswith(text[len(text) - n :]):
                    best = n
                    break
        return best
