"""Page allocator for the paged KV pool.

Free pages are kept as maximal runs of consecutive page ids, ordered by start address.
Allocation prefers one contiguous run (the lowest-address free run that fits), because the
KV transfer engine sends each contiguous run of pages as a single transfer; only when no
single run is long enough does it gather pages from several runs, lowest addresses first.

Accounting is exact: `num_free + num_used == num_total` at all times, and freeing a page
that is already free (or out of range) raises `ValueError` before anything is changed, so
a leaked or doubly-freed page is caught where it happens.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` tokens (the last one possibly partial)."""
    return (tokens + page_size - 1) // page_size


class PageAllocator:
    """Hands out page ids in `[0, num_pages)`."""

    def __init__(self, num_pages: int):
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self._num_total = num_pages
        # Invariant: runs are disjoint, non-adjacent (always merged) and sorted by start.
        self._starts: list[int] = [0] if num_pages else []
        self._lengths: dict[int, int] = {0: num_pages} if num_pages else {}
        self._num_free = num_pages

    @property
    def num_total(self) -> int:
        return self._num_total

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self._num_total - self._num_free

    def free_runs(self) -> list[tuple[int, int]]:
        """The free pages as `(start, length)` runs in address order."""
        return [(s, self._lengths[s]) for s in self._starts]

    def is_free(self, page: int) -> bool:
        i = bisect.bisect_right(self._starts, page) - 1
        return i >= 0 and page < self._starts[i] + self._lengths[self._starts[i]]

    def alloc(self, n: int) -> list[int] | None:
        """Take `n` pages, ascending; None (and nothing taken) when fewer than `n` are free.

        Returns one contiguous run whenever some free run has at least `n` pages: the
        lowest-address such run, taken from its start.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self._num_free:
            return None
        if n == 0:
            return []
        for start in self._starts:
            if self._lengths[start] >= n:
                self._take(start, n)
                return list(range(start, start + n))
        pages: list[int] = []
        while len(pages) < n:
            start = self._starts[0]
            take = min(self._lengths[start], n - len(pages))
            self._take(start, take)
            pages.extend(range(start, start + take))
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the pool. Raises ValueError, changing nothing, on a page that is
        out of range, already free, or listed twice."""
        runs = self._validated_runs(pages)
        for start, length in runs:
            self._insert_run(start, length)
        self._num_free += sum(length for _, length in runs)

    def _validated_runs(self, pages: Iterable[int]) -> list[tuple[int, int]]:
        ordered = sorted(pages)
        runs: list[tuple[int, int]] = []
        prev = None
        for p in ordered:
            if not 0 <= p < self._num_total:
                raise ValueError(f"page {p} out of range [0, {self._num_total})")
            if p == prev:
                raise ValueError(f"page {p} freed twice in one call")
            if self.is_free(p):
                raise ValueError(f"double free of page {p}")
            if runs and runs[-1][0] + runs[-1][1] == p:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((p, 1))
            prev = p
        return runs

    def _take(self, start: int, n: int) -> None:
        """Remove the first `n` pages of the free run beginning at `start`."""
        length = self._lengths.pop(start)
        i = bisect.bisect_left(self._starts, start)
        if length == n:
            del self._starts[i]
        else:
            self._starts[i] = start + n
            self._lengths[start + n] = length - n
        self._num_free -= n

    def _insert_run(self, start: int, length: int) -> None:
        """Add a run of used pages back, merging with free neighbours on either side."""
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] == start + length:
            length += self._lengths.pop(start + length)
            del self._starts[i]
        if i > 0:
            left = self._starts[i - 1]
            if left + self._lengths[left] == start:
                self._lengths[left] += length
                return
        self._starts.insert(i, start)
        self._lengths[start] = length
