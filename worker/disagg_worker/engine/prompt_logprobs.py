"""The prompt's own logprobs (completions' `echo` with `logprobs`), from the forward that computes the prompt.

A request that asks (`SamplingParams.prompt_logprobs`) gets logits at every position of its prompt chunks
(`build_forward`), and is computed without the prefix cache (a cached position has no logits). After the
forward, `split` takes each such chunk's rows out: position p's log-softmax scores prompt token p + 1 (and
its top-N alternatives), the last row stays for sampling, as if the chunk had had one row. The values are
log_softmax of the model's logits, as the sampled tokens' logprobs are (`engine/sampling.py`).
"""

from __future__ import annotations

import torch

from disagg_worker.engine.request import Req

# (first prompt position scored, [(logprob, top-N)]): position p scores prompt token p + 1.
PromptScores = tuple[int, list[tuple[float, list[tuple[int, float]]]]]


def wants_rows(req: Req, start: int) -> bool:
    """Whether a chunk from `start` of `req` gets logits at every position: it scores prompt tokens."""
    return req.params.prompt_logprobs and start < len(req.prompt_ids) - 1


def split(
    reqs: list[Req], extend: list[int], seq_lens: list[int], counts: list[int], logits: torch.Tensor
) -> tuple[torch.Tensor, list[int], dict[int, PromptScores]]:
    """(the logits sampling reads, each request's row count in them, the scores of the prompt chunks)."""
    keep: list[int] = []
    kept_counts: list[int] = []
    scores: dict[int, PromptScores] = {}
    row = 0
    for i, (req, n, end, c) in enumerate(zip(reqs, extend, seq_lens, counts, strict=True)):
        start = end - n
        if c == n and wants_rows(req, start):
            scores[i] = (start, _score(req, start, logits[row : row + n]))
            keep.append(row + n - 1)
            kept_counts.append(1)
        else:
            keep.extend(range(row, row + c))
            kept_counts.append(c)
        row += c
    return logits[torch.tensor(keep, dtype=torch.long, device=logits.device)], kept_counts, scores


def _score(req: Req, start: int, rows: torch.Tensor) -> list[tuple[float, list[tuple[int, float]]]]:
    prompt = req.prompt_ids
    n = min(len(rows), len(prompt) - 1 - start)  # the last prompt position scores no prompt token
    lps = torch.log_softmax(rows[:n].float(), dim=-1)
    targets = torch.tensor(prompt[start + 1 : start + 1 + n], dtype=torch.long, device=lps.device)
    chosen = lps.gather(1, targets[:, None])[:, 0].tolist()
    top = req.params.logprobs or 0
    if top <= 0:
        return [(lp, []) for lp in chosen]
    values, ids = lps.topk(top, dim=-1)
    tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return list(zip(chosen, tops, strict=True))
