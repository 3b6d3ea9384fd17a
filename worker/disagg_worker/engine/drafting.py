"""Drafts from a model: EAGLE (a one-layer head reading the target's hidden states, `model/eagle.py`) and
STANDALONE (a smaller model with the target's tokenizer), as chains of `num_steps` tokens.

The draft's KV lives at the target's page indices (the request's page table serves both), in pool layers of
its own (`engine.pools.build_kv_pool`): so prefill sends it with the target's pages and decode drafts from its
first step without running the prompt again. A request's draft state (`DraftState`, on the request):
the draft KV holds positions [0, valid); the target computed [0, end); EAGLE keeps the target's hidden states
of [valid, end) until the token after each is known, since draft position i reads (token i+1, hidden i).

One step of a drafting request whose known tokens are t_0..t_{N-1}:
1. `fill`, before the target forward: the draft catches up on what the target computed since its last
   draft (EAGLE: positions [valid, N-1) with tokens t_{valid+1}..t_{N-1}; STANDALONE: [valid, N) with
   t_valid..t_{N-1}), one batched extend for every drafting request, whose last row gives the first draft
   token (greedy); then one batched decode forward per further draft token, each reading the one before
   (EAGLE: with the draft's own output hidden state in place of the target's). The tokens go into the
   plan's room for them (`ScheduledBatch.drafts`, the forward's input ids). A request with nothing to
   catch up on (decode's first step after a transfer) starts from `DraftState.head`, prefill's last draft
   output, received in the aux record.
2. The target verifies (`speculative.verify`); drafts are greedy, so keeping a draft exactly when it is the
   token the target samples is the rejection rule for a draft that puts all its mass on one token.
3. `observe`, after sampling: EAGLE records the target's hidden states of the kept positions.
Draft KV written past what was kept is overwritten by the next catch-up. A request whose positions jump
(retracted and recomputed, or a prefix found in the cache) starts its state again where its forward starts:
draft KV of cached pages is used as found. A draft only changes how many tokens are accepted, never which.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from disagg_worker.config import ConfigError, EngineConfig
from disagg_worker.engine.batch import ScheduledBatch, StepResult
from disagg_worker.engine.request import Req
from disagg_worker.model import eagle
from disagg_worker.model.batch import ForwardBatch
from disagg_worker.model.config import ModelConfig
from disagg_worker.model.decoder import CausalLM
from disagg_worker.model.layers import KVCacheView
from disagg_worker.model.loader import load_model, model_config
from disagg_worker.model.tokenizer import Tokenizer

_FLAG = "--speculative-draft-model-path"
_COUNT = struct.Struct("<I")
# EAGLE hidden states a request keeps for its next catch-up (a request pausing from drafting adds one a step):
# beyond, it catches up from where it is (draft KV before that is stale: fewer drafts kept, never other tokens).
MAX_BACKLOG = 256
_TOP = struct.Struct("<qf")


@dataclass
class DraftState:
    valid: int  # draft KV holds positions [0, valid)
    end: int  # the target computed positions [0, end)
    hidden: list[torch.Tensor] = field(default_factory=list)  # EAGLE: target hidden states of [valid, end)
    head: tuple[int, torch.Tensor | None] | None = None  # the draft's last output: next token, its hidden state


@dataclass
class _Chain:
    """One drafting request within `fill`."""

    req: Req
    index: int  # in the batch
    length: int  # draft tokens to make
    start: int  # first catch-up position
    tokens: list[int]  # catch-up input tokens
    first: int  # position of the first draft token's input
    hidden: torch.Tensor | None = None  # EAGLE: catch-up hidden states
    drafts: list[int] = field(default_factory=list)
    last: torch.Tensor | None = None  # EAGLE: the draft's output hidden state for the next position


class PoolLayers:
    """The draft's view of the KV pool: its layer i is pool layer `offset + i` (after the target's)."""

    def __init__(self, pool: KVCacheView, offset: int):
        self.pool, self.offset = pool, offset
        self.page_size = pool.page_size

    def k_buffer(self, layer: int) -> torch.Tensor:
        return self.pool.k_buffer(self.offset + layer)

    def v_buffer(self, layer: int) -> torch.Tensor:
        return self.pool.v_buffer(self.offset + layer)

    def latent_buffer(self, layer: int) -> torch.Tensor:
        return self.pool.latent_buffer(self.offset + layer)


class ModelDrafter:
    def __init__(self, model: eagle.EagleHead | CausalLM, kv: KVCacheView, page_size: int, topk: int = 1):
        self.model: Any = model  # called as its kind needs: (batch, kv) or (batch, kv, hidden)
        self.kv = kv
        self.page_size = page_size
        self.eagle = isinstance(model, eagle.EagleHead)
        self.topk = topk

    # ---- before the target forward ------------------------------------------------------------
    @torch.inference_mode()
    def fill(self, batch: ScheduledBatch) -> None:
        """Compute the draft tokens the plan made room for, into `batch.drafts` and its input ids."""
        if batch.drafts is None:
            return
        chains = [self._chain(batch.reqs[i], i, len(d)) for i, d in enumerate(batch.drafts) if d]
        self._catch_up([c for c in chains if c.tokens])
        for c in chains:
            if not c.tokens:
                head = c.req.draft.head if c.req.draft is not None else None
                c.drafts, c.last = ([head[0]], head[1]) if head is not None else ([0], None)
        for step in range(1, max((c.length for c in chains), default=0)):
            self._decode_step([c for c in chains if c.length > step], step)
        offsets = torch.cumsum(torch.tensor(batch.forward.extend_lens), 0).tolist()
        for c in chains:
            batch.drafts[c.index] = c.drafts
            end = offsets[c.index]
            batch.forward.input_ids[end - c.length : end] = torch.tensor(c.drafts, dtype=torch.long)

    def _chain(self, req: Req, index: int, length: int) -> _Chain:
        n = len(req.prompt_ids) + len(req.output_ids)
        st = req.draft if req.draft is not None else DraftState(valid=n - 1, end=n - 1)
        req.draft = st
        if self.eagle:
            if sum(h.shape[0] for h in st.hidden) != n - 1 - st.valid:
                st.valid, st.hidden = st.end, []  # lost track (should not happen): start again from here
            start, tokens, first = st.valid, req.tokens(st.valid + 1, n), n - 1
            hidden = torch.cat(st.hidden) if st.hidden else None
            st.valid, st.hidden = max(st.valid, n - 1), []
        else:
            start, tokens, first, hidden = st.valid, req.tokens(st.valid, n), n, None
            st.valid = n
        return _Chain(req, index, length, start, tokens, first, hidden)

    def _catch_up(self, chains: list[_Chain]) -> None:
        if not chains:
            return
        fwd = self._forward([c.req for c in chains], [c.start for c in chains], [c.tokens for c in chains])
        tokens, last = self._run(fwd, [c.hidden for c in chains])
        for k, c in enumerate(chains):
            c.drafts = [tokens[k]]
            c.last = last[k] if last is not None else None
            c.req.draft.head = (tokens[k], c.last)

    def _decode_step(self, chains: list[_Chain], step: int) -> None:
        """Draft token `step + 1` of each chain, from token `step` at its position."""
        starts = [c.first + step - 1 for c in chains]
        fwd = self._forward([c.req for c in chains], starts, [[c.drafts[-1]] for c in chains])
        hidden = [c.last[None] if c.last is not None else None for c in chains]
        tokens, last = self._run(fwd, hidden)
        for k, c in enumerate(chains):
            c.drafts.append(tokens[k])
            c.last = last[k] if last is not None else None

    def _run(self, fwd: ForwardBatch, hidden: list[torch.Tensor | None]) -> tuple[list[int], torch.Tensor | None]:
        """The draft's greedy next token after each request's last row, and (EAGLE) its output hidden state."""
        if not self.eagle:
            return self.model(fwd, self.kv).argmax(-1).tolist(), None
        dev = self.model.fc.weight.device  # the aux record's hidden state arrives on the CPU
        rows = [
            h.to(dev) if h is not None else torch.zeros(n, self.model.config.hidden_size, device=dev)
            for h, n in zip(hidden, fwd.extend_lens, strict=True)
        ]
        out = self.model(fwd, self.kv, torch.cat(rows))
        last = out[fwd.logits_indices]
        return self.model.logits(last).argmax(-1).tolist(), last

    def _forward(self, reqs: list[Req], starts: list[int], tokens: list[list[int]]) -> ForwardBatch:
        """A forward over `tokens[i]` at positions from `starts[i]` of request i, in its pages."""
        ps = self.page_size
        slots, kv_slots = [], []
        for r, s, t in zip(reqs, starts, tokens, strict=True):
            end = s + len(t)
            table = torch.tensor(r.pages[: (end + ps - 1) // ps], dtype=torch.long)
            pos = torch.arange(end)
            seq = table[pos // ps] * ps + pos % ps
            kv_slots.append(seq)
            slots.append(seq[s:])
        return ForwardBatch(
            input_ids=torch.tensor([x for t in tokens for x in t], dtype=torch.long),
            positions=torch.cat([torch.arange(s, s + len(t)) for s, t in zip(starts, tokens, strict=True)]),
            out_slots=torch.cat(slots),
            extend_lens=[len(t) for t in tokens],
            seq_lens=[s + len(t) for s, t in zip(starts, tokens, strict=True)],
            kv_slots=kv_slots,
        )

    # ---- after sampling -----------------------------------------------------------------------
    def observe(self, batch: ScheduledBatch, result: StepResult, hidden: torch.Tensor | None) -> None:
        """Record what the target computed and kept of each request (EAGLE: its hidden states, `hidden` being
        the target's final hidden state of every input row)."""
        fwd, row = batch.forward, 0
        for i, req in enumerate(batch.reqs):
            n, start = fwd.extend_lens[i], fwd.seq_lens[i] - fwd.extend_lens[i]
            kept = n - len(batch.draft(i)) + len(result.extra.get(i, [])) if batch.samples[i] else n
            st = req.draft
            if st is None or st.end != start:
                st = req.draft = DraftState(valid=start, end=start)
            if self.eagle and hidden is not None:
                if not req.handoff and st.end - st.valid + kept > MAX_BACKLOG:
                    st.valid, st.hidden = st.end, []  # paused long: catch up from here, not over all of it
                st.hidden.append(hidden[row : row + kept].clone())
            st.end = start + kept
            row += n

    def handoff(self, req: Req, token: int) -> bytes:
        """Prefill: the draft's prefill of `req`, whose first output token is `token`, into the draft KV at the
        request's pages; returns the aux record decode starts drafting from (EAGLE: the draft's top-k and
        output hidden state at the last prompt position; STANDALONE: nothing)."""
        st = req.draft
        n = len(req.prompt_ids)
        if st is None:
            return b""
        req.draft = None  # decode goes on from here; this instance is done with the request
        if not self.eagle:
            tokens = req.tokens(st.valid, n)
            if tokens:
                with torch.inference_mode():
                    self.model(self._forward([req], [st.valid], [tokens]), self.kv)
            return b""
        tokens = req.tokens(st.valid + 1, n) + [token]
        if sum(h.shape[0] for h in st.hidden) != len(tokens):
            return b""  # should not happen; decode then drafts its first step from nothing
        with torch.inference_mode():
            out = self.model(self._forward([req], [st.valid], [tokens]), self.kv, torch.cat(st.hidden))[-1]
            probs = torch.softmax(self.model.logits(out[None])[0], -1)
        p, ids = probs.topk(self.topk)
        return pack_draft_head(ids.tolist(), p.tolist(), out)


def received_draft(prompt_len: int, data: bytes) -> DraftState:
    """Decode: the draft state of a request whose prompt KV (the draft's included) came from prefill, with
    prefill's last draft output when it sent one (EAGLE)."""
    head = unpack_draft_head(data)
    st = DraftState(valid=prompt_len, end=prompt_len)
    if head is not None:
        top, hidden = head
        st.head = (top[0][0], hidden)
    return st


def pack_draft_head(ids: list[int], probs: list[float], hidden: torch.Tensor) -> bytes:
    """EAGLE's hand-off in the aux record: the draft's top-k (token, probability) and its output hidden state."""
    h = hidden.detach().float().cpu().contiguous()
    return (
        _COUNT.pack(len(ids))
        + b"".join(_TOP.pack(i, p) for i, p in zip(ids, probs, strict=True))
        + _COUNT.pack(h.numel())
        + h.numpy().tobytes()
    )


def unpack_draft_head(data: bytes) -> tuple[list[tuple[int, float]], torch.Tensor] | None:
    """The top-k and hidden state of `pack_draft_head`; None for an empty record."""
    if len(data) < _COUNT.size:
        return None
    (k,) = _COUNT.unpack_from(data)
    if k == 0:
        return None
    top = [_TOP.unpack_from(data, _COUNT.size + j * _TOP.size) for j in range(k)]
    at = _COUNT.size + k * _TOP.size
    (h,) = _COUNT.unpack_from(data, at)
    at += _COUNT.size
    hidden = torch.frombuffer(bytearray(data[at : at + 4 * h]), dtype=torch.float32)
    return top, hidden


def draft_head_nbytes(topk: int, hidden_size: int) -> int:
    return 2 * _COUNT.size + topk * _TOP.size + 4 * hidden_size


@dataclass(frozen=True)
class Draft:
    """A loaded draft model and the KV it needs per layer."""

    model: eagle.EagleHead | CausalLM
    num_layers: int
    num_kv_heads: int
    head_dim: int
    fingerprint: str = ""  # of its config and weight files: prefill and decode must load the same draft


def load_draft(cfg: EngineConfig, target: CausalLM, target_cfg: ModelConfig) -> Draft | None:
    """The draft model of `cfg`'s EAGLE or STANDALONE speculation (None otherwise); one that cannot draft for
    the target (another vocabulary or tokenizer, another hidden size) is a ConfigError naming the flag."""
    spec = cfg.scheduler.speculative
    if not spec.uses_draft_model:
        return None
    path = spec.draft_model_path
    try:
        draft = _read_draft(spec.algorithm, path, cfg, target, target_cfg)
    except ConfigError:
        raise
    except (OSError, ValueError) as e:
        raise ConfigError(f"{_FLAG} {path}: {e}") from e
    return dataclasses.replace(draft, fingerprint=fingerprint(path))


def fingerprint(path: str) -> str:
    """A short hash of a draft's config and of its weight files' names and sizes."""
    p = Path(path)
    files = sorted(f for f in ([p] if p.is_file() else p.iterdir()) if f.is_file())
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes() if f.suffix == ".json" else str(f.stat().st_size).encode())
    return h.hexdigest()[:12]


def _read_draft(algorithm: str, path: str, cfg: EngineConfig, target: CausalLM, target_cfg: ModelConfig) -> Draft:
    flag, dtype = _FLAG, getattr(torch, cfg.dtype)
    context = cfg.max_context_len or target_cfg.max_position_embeddings
    if algorithm == "EAGLE":
        head_cfg = eagle.read_config(path)
        problem = _mismatch(
            ("vocab_size", head_cfg.vocab_size, target_cfg.vocab_size),
            ("hidden_size", head_cfg.hidden_size, target_cfg.hidden_size),
        )
        if not problem and head_cfg.max_position_embeddings < context:
            problem = f"its positions end at {head_cfg.max_position_embeddings}, the context at {context}"
        if problem:
            raise ConfigError(f"{flag} {path}: the EAGLE head does not fit the model: {problem}")
        model = eagle.load_eagle(path, target, dtype, cfg.device, pool_layer=0)
        return Draft(model, 1, head_cfg.num_kv_heads, head_cfg.head_dim)
    draft_cfg = model_config(path)
    problem = _mismatch(("vocab_size", draft_cfg.vocab_size, target_cfg.vocab_size))
    if not problem and draft_cfg.max_position_embeddings < context:
        problem = (
            f"its positions end at {draft_cfg.max_position_embeddings}, the context (--max-context-len) at {context}"
        )
    if not problem and Tokenizer.from_path(path).tok.get_vocab() != Tokenizer.from_path(cfg.model_path).tok.get_vocab():
        problem = "its tokenizer's vocabulary differs from the model's"
    if problem:
        raise ConfigError(f"{flag} {path}: the draft model cannot draft for {cfg.model_path}: {problem}")
    if draft_cfg.mla is not None:
        raise ConfigError(f"{flag} {path}: a draft model with latent attention (MLA) is not supported")
    small, _ = load_model(path, dtype, cfg.device)
    return Draft(small, draft_cfg.num_layers, draft_cfg.num_kv_heads, draft_cfg.head_dim)


def _mismatch(*pairs: tuple[str, int, int]) -> str:
    return "; ".join(f"{name} {a}, the model's {b}" for name, a, b in pairs if a != b)
