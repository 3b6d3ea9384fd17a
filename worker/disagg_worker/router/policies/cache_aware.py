"""cache_aware (`router/kv_index.py`, needs `--tokenizer`): prefill by the lowest cost, the prompt's tokens the
worker has not cached plus the uncached tokens of this router's prefills still running there, so a miss goes to
the least loaded worker, not to the one that caches most; decode by least load (`least_load.by_load`). Guard:
while some prefill worker is idle, one with `balance_tokens` or more pending takes no more (a stream of long
prompts sharing a prefix does not pin one worker).

Conditional disaggregation (`PrefixScore.decode_only_tokens` > 0) lives here too, since it needs the index of
decode's cache: decode is picked first, the least loaded of those that could compute the prompt themselves
when there is one (a follow-up turn goes back to the decode that holds its history); when the prompt tokens it
lacks are at most that many, it computes them itself and no prefill takes part (no bootstrap, no transfer).

Each request's choice is counted in `PrefixScore.decisions`: "cache_hit" (the prefill holds part of the prompt),
"load" (none does, or none usefully), "balanced" (the guard moved it), "decode_only".
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg_worker.router.policies.least_load import by_load
from disagg_worker.router.policies.prefix import PrefixScore, Prompt
from disagg_worker.router.worker import Worker


@dataclass
class CacheAware:
    score: PrefixScore

    def indexed(self, w: Worker) -> bool:
        """Every prefill; decode too when it may compute prompts itself."""
        return w.role == "prefill" or self.score.decode_only_tokens > 0

    def pick(self, role: str, candidates: list[Worker], prompt: Prompt | None) -> Worker:
        if role == "prefill":
            return self._prefill(candidates, prompt)
        able = [w for w in candidates if self._could(w, prompt)]
        if able and prompt is not None:
            return min(able, key=lambda w: (w.busy, self.score.uncached(w, prompt), w.failures))
        return min(candidates, key=by_load)

    def decode_only(self, d: Worker, prompt: Prompt | None) -> bool:
        """Decode `d` lacks few enough of the prompt's tokens to compute them itself; counted as a decision."""
        if not self._could(d, prompt):
            return False
        self.score.decisions["decode_only"] += 1
        return True

    def _could(self, d: Worker, prompt: Prompt | None) -> bool:
        """With conditional disaggregation on and a prompt read: `d` says it computes prompts itself
        (`local_prefill` on its /health) and lacks few enough of this one's."""
        limit = self.score.decode_only_tokens
        if prompt is None or limit <= 0:
            return False
        return d.report.get("local_prefill") is True and self.score.uncached(d, prompt) <= limit

    def _prefill(self, candidates: list[Worker], prompt: Prompt | None) -> Worker:
        score = self.score
        cost = {w: score.uncached(w, prompt) + w.pending_tokens for w in candidates}
        best = min(candidates, key=lambda w: (cost[w], w.inflight, w.failures))
        idle = [w for w in candidates if w.pending_tokens == 0 and w.inflight == 0]
        if idle and best not in idle and best.pending_tokens >= score.balance_tokens:
            score.decisions["balanced"] += prompt is not None
            return min(idle, key=lambda w: (cost[w], w.failures))
        if prompt is not None:  # a request's choice (readiness checks pick without a prompt)
            score.decisions["cache_hit" if score.uncached(best, prompt) < prompt.tokens else "load"] += 1
        return best
