"""Cache-aware routing to a prefill instance with DP attention (two attention groups, each its own prefix cache),
on real processes: a follow-up runs on the group that holds its prefix, as each group's cache hits show."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import pytest
import requests

from disagg_worker.mem.kv_events import page_hashes
from disagg_worker.model.tiny import make_tiny
from tests.integration.procs import PDStack, report_after, scaled, wait_until
from tests.integration.test_kv_events import router_index_reaches
from tests.integration.test_pd import FLAGS
from tests.integration.test_pd_quarantine import bootstrapping
from tests.integration.test_server import generate

pytestmark = pytest.mark.integration
PAGE = 4  # FLAGS' page size
DP2 = ("--tp-size", "2", "--enable-dp-attention", "--dp-size", "2")


def groups_holding(url: str, prefixes: list[list[int]]) -> list[int] | None:
    """The attention group holding each prefix's pages (None until every prefix is held by exactly one)."""
    body = requests.get(f"{url}/kv_events", timeout=scaled(5)).json()
    held = {int(g): {int(n, 16) for n in names} for g, names in body["snapshot"].items()}
    found = []
    for ids in prefixes:
        names = set(page_hashes(ids, PAGE))
        where = [g for g, pages in held.items() if names <= pages]
        if len(where) != 1:
            return None
        found.append(where[0])
    return found


def group_hits(url: str, since: float) -> list[int]:
    st = report_after(url, since, lambda st: len(st.get("groups", [])) == 2, scaled(10), "both groups' reports")
    return [g["cache_hit_tokens"] for g in st["groups"]]


def test_a_follow_up_runs_on_the_attention_group_that_holds_its_prefix(tmp_path):
    model = str(make_tiny(tmp_path / "deepseek_v3", arch="deepseek_v3"))
    router_flags = ("--policy", "cache_aware", "--tokenizer", model)
    stack = PDStack(model, *FLAGS, prefill_flags=DP2, router_flags=router_flags).wait_healthy()
    try:
        # Distinct 64-token prefixes, all open at once: decode is frozen, so prefill holds every room until it
        # resumes, and the router places each by the tokens its earlier picks left pending there: 4 per group.
        prefixes = [list(range(100 + 80 * i, 164 + 80 * i)) for i in range(8)]
        # Until the router has indexed the prefill once it knows no page size and reads no prompt.
        router_index_reaches(stack.router.url, stack.prefill.url, lambda i: i["state"] == "ok", "the prefill indexed")
        os.killpg(stack.decode.proc.pid, signal.SIGSTOP)
        try:
            with cf.ThreadPoolExecutor(len(prefixes)) as pool:
                futures = [pool.submit(generate, stack.router.url, ids + [1], 2) for ids in prefixes]
                wait_until(
                    lambda: bootstrapping(stack.prefill.url) == len(prefixes),
                    timeout=30,
                    interval=0.05,
                    what="prefill holding every first turn",
                )
                os.killpg(stack.decode.proc.pid, signal.SIGCONT)
                for f in futures:
                    f.result()
        finally:
            os.killpg(stack.decode.proc.pid, signal.SIGCONT)
        where = wait_until(lambda: groups_holding(stack.prefill.url, prefixes), timeout=10, what="each prefix held")
        assert sorted(where) == [0] * 4 + [1] * 4, where
        router_index_reaches(stack.router.url, stack.prefill.url, lambda i: i["pages"] >= 8 * 16, "every prefix")

        before = group_hits(stack.prefill.url, time.time())
        for ids in prefixes:  # one at a time: both groups idle, so only the cache tells them apart
            generate(stack.router.url, ids + [2, 3], n=2)
        after = group_hits(stack.prefill.url, time.time())
        # Each follow-up's 64 prefix tokens came from its group's cache.
        assert [a - b for a, b in zip(after, before, strict=True)] == [64 * where.count(g) for g in (0, 1)]
        routing = requests.get(f"{stack.router.url}/health", timeout=scaled(5)).json()["routing"]
        assert routing.get("cache_hit", 0) >= len(prefixes), routing
    finally:
        stack.stop()
