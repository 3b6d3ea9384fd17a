"""Speculative decoding: more than one token per decode step, from drafts verified in one forward.

NGRAM drafts (prompt lookup) pay when a request repeats what it has already seen (editing a given text,
quoting a passage, code); EAGLE and STANDALONE draft with a model (`engine/drafting.py`), whose tokens the
runner fills in where the plan left room for them.

Path of a draft: `Scheduler._plan_drafts` asks `DraftPlanner.propose` for a running request's next tokens
(NGRAM) or for room for them (a draft model's, computed by the runner just before the forward) ->
the request's forward computes its last token and the draft together, with logits at every one of those
positions (`ForwardBatch.num_logits`) -> `verify` samples the target at the first position, and at each next
one only while the token sampled so far equals the draft's -> `Scheduler.process` appends the sampled tokens
and gives back the KV slots of the rejected ones (they are simply overwritten later).

Verification samples exactly as a step without speculation would: the same penalties over the tokens before,
the same grammar state, the same draws from the request's generator, one per emitted token. A draft token is
kept only when it is the token the target samples there, so greedy and seeded answers are token-identical with
and without speculation, and the sampled distribution is the target's (the rejection rule of speculative
sampling for a draft that puts all its mass on one token).

Drafts cost compute when they are rejected: every draft token is a row of the forward, and on a CPU a forward
of two to eight rows per request costs about 1.5x one of one row (small matrix products leave the
matrix-vector path), plus a draft model's own forwards. So a draft's length follows what the request's drafts
achieve: a draft kept whole lets the next grow by a token (up to the algorithm's maximum); one cut short makes
the next at most one token longer than what was kept. A draft model's first draft is two tokens (an n-gram's
starts at the maximum: it costs nothing to make). And a request whose drafts do not pay pauses (`PauseRule`:
`NGRAM_RULE`, `MODEL_RULE`), then tries again. A text that never repeats itself produces no n-gram match
and so no NGRAM draft at all.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from prometheus_client import Counter, Histogram

from disagg_worker.config import SpeculativeConfig
from disagg_worker.engine.sampling import SampleOutput, Sampler, SamplingState


@dataclass(frozen=True)
class PauseRule:
    """When a request stops drafting for a while: its last `window` drafted steps kept fewer than
    `min_kept_per_step` draft tokens per step (too little gained; 0: not judged), or its last `share_window`
    drafted tokens fewer than `min_share` of them (too many rows wasted). It then drafts nothing for `pause`
    decode steps, twice as long after each pause in a row, at most `pause << max_doublings`."""

    window: int
    min_kept_per_step: float
    share_window: int
    min_share: float
    pause: int
    max_doublings: int


# An n-gram draft costs only its rows of the forward, and comes in bursts (a match, then none): judged on its
# share over many tokens (measured: plain chat at concurrency 1 1.12x with this rule, 1.04x when also judged
# per two steps).
NGRAM_RULE = PauseRule(window=0, min_kept_per_step=0.0, share_window=32, min_share=0.25, pause=64, max_doublings=0)
# A draft model's draft also costs its forwards every step (a drafted step ~85 ms against 40 for a plain one,
# SmolLM2 with an EAGLE head on 2 cores): judged after two steps, and paused longer each time.
MODEL_RULE = PauseRule(window=2, min_kept_per_step=0.5, share_window=32, min_share=0.25, pause=128, max_doublings=4)

DRAFTED = Counter("disagg_spec_draft_tokens_total", "draft tokens proposed and verified")
ACCEPTED = Counter("disagg_spec_accepted_tokens_total", "draft tokens accepted (equal to the target's sample)")
ACCEPT_LENGTH = Histogram(
    "disagg_spec_accept_length",
    "tokens a verified draft added to its request in one step: accepted drafts plus the target's own token",
    buckets=tuple(range(1, 18)),
)


def propose_ngram(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of `tokens` of
    `max_n` down to `min_n` tokens; [] when no such suffix occurred before."""
    count = len(tokens)
    if k <= 0 or count <= min_n:
        return []
    ids = array("q", tokens)
    buf, width = ids.tobytes(), ids.itemsize
    for n in range(min(max_n, count - 1), min_n - 1, -1):
        pattern = buf[-width * n :]
        end = width * (count - 1)  # an occurrence must end before the last token: something follows it
        while True:
            at = buf.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % width == 0:
                start = at // width + n
                return list(tokens[start : start + k])
            end = at + len(pattern) - 1  # a match across token boundaries: look further back
    return []


@dataclass
class DraftStats:
    """A request's recent acceptance, for the draft length and pause rules."""

    length: int  # the longest draft it may make next
    steps: int = 0  # drafted steps in the current window
    accepted: int = 0  # draft tokens they kept
    drafted_tokens: int = 0  # drafted tokens in the current share window
    kept_tokens: int = 0  # of which kept
    paused_until: int = 0  # the scheduler step from which it may draft again
    failures: int = 0  # windows in a row that paused it


@dataclass
class DraftPlanner:
    """How long each request's next draft may be, and (NGRAM) the draft itself."""

    cfg: SpeculativeConfig
    stats: dict[str, DraftStats] = field(default_factory=dict)

    @property
    def rule(self) -> PauseRule:
        return MODEL_RULE if self.cfg.uses_draft_model else NGRAM_RULE

    def may_draft(self, rid: str, step: int) -> bool:
        """False while request `rid` is paused (checked before its tokens are gathered for `propose`)."""
        return step >= self._stats(rid).paused_until

    def propose(self, rid: str, tokens: Sequence[int], limit: int) -> list[int]:
        """The draft of request `rid` whose tokens so far are `tokens`, at most `limit` tokens long."""
        length = min(self._stats(rid).length, limit)
        if self.cfg.uses_draft_model:
            return [0] * length  # room for the draft model's tokens (`drafting.ModelDrafter.fill`)
        return propose_ngram(tokens, length, self.cfg.min_match, self.cfg.max_match)

    def record(self, rid: str, drafted: int, accepted: int, step: int) -> None:
        """A verified draft of `drafted` tokens, `accepted` of them kept (before any ended the request)."""
        DRAFTED.inc(drafted)
        ACCEPTED.inc(accepted)
        ACCEPT_LENGTH.observe(accepted + 1)
        s = self._stats(rid)
        s.length = min(self.cfg.max_draft, s.length + 1 if accepted == drafted else accepted + 1)
        s.steps += 1
        s.accepted += accepted
        s.drafted_tokens += drafted
        s.kept_tokens += accepted
        rule = self.rule
        few = 0 < rule.window <= s.steps and s.accepted < rule.min_kept_per_step * s.steps
        wasteful = s.drafted_tokens >= rule.share_window and s.kept_tokens < rule.min_share * s.drafted_tokens
        if few or wasteful:
            s.paused_until = step + (rule.pause << min(s.failures, rule.max_doublings))
            s.failures += 1
            s.steps = s.accepted = s.drafted_tokens = s.kept_tokens = 0
            return
        if rule.window and s.steps >= rule.window:  # a window that paid
            s.failures = 0
            s.steps = s.accepted = 0
        if s.drafted_tokens >= rule.share_window:
            s.failures = 0
            s.drafted_tokens = s.kept_tokens = 0

    def _stats(self, rid: str) -> DraftStats:
        if rid not in self.stats:
            # A draft model's drafts cost its forwards: they start at two tokens and grow as they are kept.
            self.stats[rid] = DraftStats(
                length=min(2, self.cfg.max_draft) if self.cfg.uses_draft_model else self.cfg.max_draft
            )
        return self.stats[rid]

    def forget(self, rid: str) -> None:
        self.stats.pop(rid, None)


@dataclass
class Emitted:
    """What one request's step produced: its tokens, with their logprobs when asked for."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    tops: list[list[tuple[int, float]] | None] = field(default_factory=list)

    def add(self, out: SampleOutput, k: int) -> None:
        self.tokens.append(out.token_ids[k])
        self.logprobs.append(out.logprobs[k] if out.logprobs is not None else None)
        self.tops.append(out.top_logprobs[k] if out.top_logprobs is not None else None)


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    first_rows: list[int],
    states: list[SamplingState],
    outputs: list[list[int]],
    drafts: list[list[int]],
) -> list[Emitted]:
    """Sample each request at its first logits row (`first_rows[i]`, the position after its last known token),
    then, round by round, at its next row while the token sampled before equals its draft's there.

    `outputs[i]`: request i's output tokens before this step; `drafts[i]`: its draft ([] for none), whose
    logits rows follow the first one. One batched `Sampler.sample` per round, so each request's penalties see
    the tokens sampled before, its grammar advances by exactly what it emits and its generator draws once per
    emitted token, as without speculation."""
    emitted = [Emitted() for _ in states]
    live = list(range(len(states)))
    depth = 0
    while live:
        rows = [first_rows[i] + depth for i in live]
        out = sampler.sample(logits[rows], [states[i] for i in live], [outputs[i] + emitted[i].tokens for i in live])
        for k, i in enumerate(live):
            emitted[i].add(out, k)
        live = [i for k, i in enumerate(live) if depth < len(drafts[i]) and out.token_ids[k] == drafts[i][depth]]
        depth += 1
    return emitted
