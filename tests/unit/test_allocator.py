"""PageAllocator: exact accounting, contiguous-first allocation, loud double frees."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from disagg_worker.mem.allocator import PageAllocator


def _lowest_run_that_fits(free: set[int], num_total: int, n: int) -> int | None:
    """Reference first-fit: start of the lowest-address run of >= n free pages."""
    run_start, run_len = 0, 0
    for p in range(num_total):
        if p in free:
            if run_len == 0:
                run_start = p
            run_len += 1
            if run_len >= n:
                return run_start
        else:
            run_len = 0
    return None


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc/free sequences checked against a set-of-free-pages model."""

    def __init__(self):
        super().__init__()
        self.num_total = 64
        self.alloc = PageAllocator(self.num_total)
        self.free_pages = set(range(self.num_total))
        self.held: list[list[int]] = []

    @rule(n=st.integers(min_value=0, max_value=24))
    def allocate(self, n):
        expected_start = _lowest_run_that_fits(self.free_pages, self.num_total, n) if n else None
        pages = self.alloc.alloc(n)
        if n > len(self.free_pages):
            assert pages is None
            return
        assert pages is not None and len(pages) == n
        assert set(pages) <= self.free_pages, "handed out a page that was not free"
        assert len(set(pages)) == n, "handed out the same page twice"
        if expected_start is not None:
            assert pages == list(range(expected_start, expected_start + n))
        self.free_pages -= set(pages)
        self.held.append(pages)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(min_value=0), part=st.booleans())
    def release(self, i, part):
        pages = self.held.pop(i % len(self.held))
        if part and len(pages) > 1:
            # Free half now and keep the rest: fragments the pool.
            self.held.append(pages[len(pages) // 2 :])
            pages = pages[: len(pages) // 2]
        self.alloc.free(reversed(pages))
        self.free_pages |= set(pages)

    @precondition(lambda self: self.free_pages)
    @rule(data=st.data())
    def double_free_raises_and_changes_nothing(self, data):
        page = data.draw(st.sampled_from(sorted(self.free_pages)))
        used = [p for held in self.held for p in held][:3]
        with pytest.raises(ValueError):
            self.alloc.free(used + [page])
        assert all(not self.alloc.is_free(p) for p in used)

    @invariant()
    def accounting_is_exact(self):
        assert self.alloc.num_free == len(self.free_pages)
        assert self.alloc.num_free + self.alloc.num_used == self.alloc.num_total
        assert {p for p in range(self.num_total) if self.alloc.is_free(p)} == self.free_pages


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_failed_alloc_takes_nothing():
    a = PageAllocator(8)
    assert a.alloc(9) is None
    assert a.num_free == 8
    assert a.alloc(8) == list(range(8))
    assert a.alloc(1) is None


def test_falls_back_to_several_runs_when_no_run_fits():
    a = PageAllocator(10)
    pages = a.alloc(10)
    a.free([pages[1], pages[2], pages[5], pages[6], pages[7], pages[9]])
    assert a.alloc(3) == [5, 6, 7]
    assert a.alloc(3) == [1, 2, 9]
    assert a.num_free == 0


def test_freed_neighbours_merge_into_one_run():
    a = PageAllocator(6)
    a.alloc(6)
    a.free([0, 1])
    a.free([4, 5])
    a.free([2, 3])
    assert a.free_runs() == [(0, 6)]
    assert a.alloc(6) == list(range(6))


@pytest.mark.parametrize("bad", [[-1], [8], [3, 3]])
def test_out_of_range_or_repeated_page_raises(bad):
    a = PageAllocator(8)
    a.alloc(8)
    with pytest.raises(ValueError):
        a.free(bad)
    assert a.num_free == 0


def test_double_free_raises():
    a = PageAllocator(4)
    pages = a.alloc(2)
    a.free(pages)
    with pytest.raises(ValueError):
        a.free(pages[:1])
    assert a.num_free == 4
