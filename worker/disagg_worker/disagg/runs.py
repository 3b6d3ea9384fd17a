"""Coalescing of page lists into contiguous runs, so one run moves as one write."""
from __future__ import annotations


def group_runs(src_pages: list[int], dst_pages: list[int]) -> list[tuple[int, int, int]]:
    """Split the pairing `src_pages[i] -> dst_pages[i]` into maximal runs.

    Returns `(src_start, dst_start, n)` triples, in input order, such that for each triple
    pages `src_start + k` map to `dst_start + k` for `k < n`, and the triples together cover
    the pairing exactly once. A run only grows while both sides advance by one page.
    """
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"page lists differ in length: {len(src_pages)} != {len(dst_pages)}")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_pages, dst_pages):
        if runs:
            rs, rd, n = runs[-1]
            if s == rs + n and d == rd + n:
                runs[-1] = (rs, rd, n + 1)
                continue
        runs.append((s, d, 1))
    return runs
