"""Coalescing of page lists into contiguous runs, so one run moves as one write.

Backend-neutral: any transfer that copies pages costs less per run than per page.
"""

from __future__ import annotations

import numpy as np

from disagg_worker.tuning import TUNING


def group_runs(src_pages: list[int], dst_pages: list[int]) -> list[tuple[int, int, int]]:
    """Split the pairing `src_pages[i] -> dst_pages[i]` into maximal runs.

    Returns `(src_start, dst_start, n)` triples, in input order, such that for each triple
    pages `src_start + k` map to `dst_start + k` for `k < n`, and the triples together cover
    the pairing exactly once. A run only grows while both sides advance by one page.
    """
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"page lists differ in length: {len(src_pages)} != {len(dst_pages)}")
    if _is_one_run(src_pages) and _is_one_run(dst_pages):  # a fresh request's pages, usually
        return [(src_pages[0], dst_pages[0], len(src_pages))] if src_pages else []
    if len(src_pages) >= TUNING.transfer.vectorise_from_pages:
        return _group_runs_np(list(src_pages), list(dst_pages))
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_pages, dst_pages, strict=True):
        if runs:
            rs, rd, n = runs[-1]
            if s == rs + n and d == rd + n:
                runs[-1] = (rs, rd, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def _is_one_run(pages: list[int]) -> bool:
    """Consecutive ascending pages; the end points are compared first, so most lists that are
    not one run cost O(1)."""
    n = len(pages)
    return n == 0 or (pages[-1] - pages[0] == n - 1 and list(pages) == list(range(pages[0], pages[0] + n)))


def _group_runs_np(src_pages: list[int], dst_pages: list[int]) -> list[tuple[int, int, int]]:
    n = len(src_pages)
    both = np.fromiter(src_pages + dst_pages, dtype=np.int64, count=2 * n).reshape(2, n)
    step = np.diff(both, axis=1)
    breaks = np.flatnonzero((step[0] != 1) | (step[1] != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.append(starts, n))
    return list(zip(both[0, starts].tolist(), both[1, starts].tolist(), lengths.tolist(), strict=True))
