"""Pages a failed KV transfer may still write, in a running P/D deployment.

A prefill that stays silent (frozen: it neither refuses connections nor answers) gets its pages back on
decode after the quarantine timeout, while it is still frozen. A decode that freezes mid-transfer and
resumes keeps the pages prefill's late writes land in out of use until prefill says it is quiet: the
greedy output of every later request is still the monolithic server's."""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import time

import pytest
import requests

from tests.integration.procs import PDStack, idle_and_flushed, report_after, scaled, serve, wait_until
from tests.integration.test_pd import FLAGS, LAYERWISE, assert_clean
from tests.integration.test_pd_faults import hold, load, outcomes, request, stall_env, wait_router_healthy
from tests.integration.test_server import generate, varied_prompts

pytestmark = pytest.mark.integration
QUARANTINE_S = 6.0


def stats(url: str) -> dict:
    return requests.get(f"{url}/stats", timeout=scaled(5)).json()


def queues(url: str) -> dict[str, int]:
    return stats(url)["queues"]


def bootstrapping(url: str) -> int:
    """Rooms prefill holds until decode sends their destination pages (one /stats read)."""
    return queues(url).get("prefill_bootstrap", 0)


def test_a_silent_prefills_pages_come_back_after_the_quarantine_timeout(tiny_model):
    stack = PDStack(tiny_model, *FLAGS, "--quarantine-timeout", str(QUARANTINE_S)).wait_healthy()
    pgid = stack.prefill.proc.pid
    try:
        with cf.ThreadPoolExecutor(32) as pool:
            # More prompt than decode holds at once: its transfer queue stays full while prefill computes.
            futures = load(stack.router.url, 32, pool, prompt_len=800)
            wait_until(
                lambda: queues(stack.decode.url).get("decode_transfer", 0) > 0,
                timeout=30,
                interval=0.02,
                what="decode waiting for KV it asked prefill for",
            )
            os.killpg(pgid, signal.SIGSTOP)
            stopped = time.time()  # the clock of the scheduler's reports
            wait_until(
                lambda: queues(stack.decode.url).get("decode_quarantine", 0),
                timeout=10,
                interval=0.05,
                what="pages quarantined after the heartbeat lost the frozen prefill",
            )
            # Every room failed after the freeze, so none is released before stopped + QUARANTINE_S. The first
            # report without quarantined rooms was made at or after the release (reports come every 0.5 s, and
            # reading them every 0.05 s sees each one): its time is the earliest the release can be shown at.
            released = wait_until(
                lambda: (st := stats(stack.decode.url))["queues"].get("decode_quarantine", 0) == 0 and st,
                timeout=QUARANTINE_S + 20,
                interval=0.05,
                what="the quarantined pages released while prefill is still frozen",
            )
            took = released["time"] - stopped
            assert took >= QUARANTINE_S, f"quarantined pages were released {took:.1f} s after the freeze"
            outcomes(futures)
        st = idle_and_flushed(stack.decode.url, timeout=20)  # prefill is still frozen here
        assert st["pages_used"] == 0 and not any(st["queues"].values()), st
    finally:
        os.killpg(pgid, signal.SIGCONT)
    try:
        wait_router_healthy(stack)
        wait_until(lambda: request(stack.router.url, 5000)[0] == "ok", timeout=60, interval=1, what="serving again")
        assert_clean(stack.prefill.url, stack.decode.url)
    finally:
        stack.stop()


def test_after_decode_freezes_and_resumes_greedy_output_still_equals_monolithic(tiny_model, tmp_path):
    # Decode runs 2 requests at a time and prefill stalls its first streamed forward after the first layer groups
    # left (`hold`): the 2 rooms decode sent destinations for are mid-transfer, every other request waits in
    # decode's prealloc queue, and nothing moves until the test releases the stall. Decode freezes first, then
    # prefill goes on: the rest of the 2 rooms' KV is written into the frozen decode's pages (late writes), and the
    # rooms still Bootstrapping end only by prefill's bootstrap timeout (a destination never leaves a frozen decode).
    release = tmp_path / "release"
    release.touch()
    stack = PDStack(
        tiny_model,
        *FLAGS,
        prefill_flags=LAYERWISE,
        decode_flags=("--max-running-requests", "2"),
        env=stall_env(release),
    ).wait_healthy()
    mono = serve(tiny_model, *FLAGS).wait_healthy()
    pgid = stack.decode.proc.pid
    try:
        with cf.ThreadPoolExecutor(16) as pool:
            futures = hold(stack, release, 16, pool, prompt_len=600)
            os.killpg(pgid, signal.SIGSTOP)
            frozen = time.time()  # the clock of the scheduler's reports
            release.touch()
            try:
                # Decode held all 16 with 2 running slots: 14 rooms never get a destination. Prefill's scheduler
                # was stalled and creates the rooms of requests that came meanwhile once it goes on.
                report_after(
                    stack.prefill.url,
                    frozen,
                    lambda st: st["queues"].get("prefill_bootstrap", 0) >= 16 - 2,
                    10,
                    "holding Bootstrapping every room the frozen decode sent no destination for",
                )
                report_after(
                    stack.prefill.url,
                    frozen,
                    lambda st: not any(st["queues"].values()),
                    40,
                    "prefill giving up on the frozen decode (its bootstrap and waiting timeouts)",
                )
            finally:
                os.killpg(pgid, signal.SIGCONT)
            outcomes(futures)
        wait_router_healthy(stack)
        assert_clean(stack.prefill.url, stack.decode.url)
        prompts = varied_prompts(24)
        expected = [generate(mono.url, p) for p in prompts]
        with cf.ThreadPoolExecutor(12) as pool:
            got = list(pool.map(lambda p: generate(stack.router.url, p), prompts))
        assert got == expected
        assert_clean(stack.prefill.url, stack.decode.url)
    finally:
        release.touch()  # a stalled forward must not hold up the stop
        mono.stop()
        stack.stop()
