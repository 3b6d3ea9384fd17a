"""The prompt's own logprobs (completions' `echo` with `logprobs`), from the forward that computes the prompt.

A request that asks (`SamplingParams.prompt_logprobs`) gets logits at every position of its prompt chunks
(`build_forward`), and is computed without the prefix cache (a cached position has no logits). After the
forward, `split` takes each such chunk's rows out: position p's log-softmax scores prompt token p + 1 (and
its top-N alternatives), the last row stays for sampling, as if the chunk had had one row. The values are
log_softmax of the model's logits, as the sampled tokens' logprobs are (`engine/sampling.py`).

Scoring is per request, inside the step's per-request boundary: a request whose scoring fails (a device out of
memory on a long chunk's rows) is named in `split`'s failed set and fails alone with a 500 naming it, its row still
sampled so the batch goes on. Rows are scored `SCORE_ROWS` at a time, so that the float copy and log-softmax of a
chunk never hold more than that many rows of the vocabulary at once.
"""

from __future__ import annotations

import logging

import torch

from disagg_worker.engine.request import Req

log = logging.getLogger(__name__)
SCORE_ROWS = 256  # prompt positions log-softmaxed at once (x vocabulary x 4 bytes of temporaries)
# (first prompt position scored, [(logprob, top-N)]): position p scores prompt token p + 1.
PromptScores = tuple[int, list[tuple[float, list[tuple[int, float]]]]]


def wants_rows(req: Req, start: int) -> bool:
    """Whether a chunk from `start` of `req` gets logits at every position: it scores prompt tokens."""
    return req.params.prompt_logprobs and start < len(req.prompt_ids) - 1


def split(
    reqs: list[Req], extend: list[int], seq_lens: list[int], counts: list[int], logits: torch.Tensor
) -> tuple[torch.Tensor, list[int], dict[int, PromptScores], set[int]]:
    """(the logits sampling reads, each request's row count in them, the scores of the prompt chunks, the
    requests whose scoring failed)."""
    keep: list[int] = []
    kept_counts: list[int] = []
    scores: dict[int, PromptScores] = {}
    failed: set[int] = set()
    row = 0
    for i, (req, n, end, c) in enumerate(zip(reqs, extend, seq_lens, counts, strict=True)):
        start = end - n
        if c == n and wants_rows(req, start):
            try:
                scores[i] = (start, score(req, start, logits[row : row + n]))
            except Exception:
                log.exception("request %s: scoring its prompt failed", req.rid)
                failed.add(i)
            keep.append(row + n - 1)
            kept_counts.append(1)
        else:
            keep.extend(range(row, row + c))
            kept_counts.append(c)
        row += c
    return logits[torch.tensor(keep, dtype=torch.long, device=logits.device)], kept_counts, scores, failed


def score(req: Req, start: int, rows: torch.Tensor) -> list[tuple[float, list[tuple[int, float]]]]:
    """The prompt tokens' scores from a chunk's `rows` (from prompt position `start`), SCORE_ROWS at a time."""
    prompt = req.prompt_ids
    n = min(len(rows), len(prompt) - 1 - start)  # the last prompt position scores no prompt token
    out: list[tuple[float, list[tuple[int, float]]]] = []
    for a in range(0, n, SCORE_ROWS):
        b = min(n, a + SCORE_ROWS)
        out += _score_rows(rows[a:b], prompt[start + 1 + a : start + 1 + b], req.params.logprobs or 0)
    return out


def _score_rows(rows: torch.Tensor, targets_ids: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    lps = torch.log_softmax(rows.float(), dim=-1)
    targets = torch.tensor(targets_ids, dtype=torch.long, device=lps.device)
    chosen = lps.gather(1, targets[:, None])[:, 0].tolist()
    if top <= 0:
        return [(lp, []) for lp in chosen]
    values, ids = lps.topk(top, dim=-1)
    tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return list(zip(chosen, tops, strict=True))
