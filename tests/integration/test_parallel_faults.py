"""A rank of a multi-rank instance dies: the instance says so at once and the router stops using it.

One rank alone cannot serve (its peers would wait for it in their next collective), so the HTTP
process watches every rank's process: when one exits, every request it holds ends with a 500
(instance_failed, not retried on another pair) naming the exit, /health turns 503 with the same
reason, and the router takes the instance out of rotation on its next health check.
The peer decode instance is left clean.
"""

from __future__ import annotations

import concurrent.futures as cf
import time

import psutil
import pytest
import requests

from tests.integration.procs import PDStack, Proc, scaled, wait_until
from tests.integration.test_parallel import mqa_model  # noqa: F401 - the fixture
from tests.integration.test_pd import FLAGS, LAYERWISE, assert_clean
from tests.integration.test_pd_faults import HELD, HOLD, hold, outcomes, stall_env

pytestmark = pytest.mark.integration
# How long decode keeps the pages of a room that failed mid-transfer while its prefill's dead rank stays silent.
QUARANTINE_S = 2.0


def rank_processes(instance: Proc) -> list[psutil.Process]:
    """The scheduler processes of an instance (one per rank), oldest first; not multiprocessing's
    resource tracker."""
    children = psutil.Process(instance.proc.pid).children()
    ranks = [c for c in children if "resource_tracker" not in " ".join(c.cmdline())]
    return sorted(ranks, key=lambda c: c.create_time())


@pytest.mark.parametrize("moment", ["busy", "idle"])
def test_a_dead_rank_of_a_tp2_prefill_fails_its_requests_at_once_and_leaves_rotation(
    mqa_model,  # noqa: F811
    moment,
    tmp_path,
):
    """Busy: requests held by prefill end with a 500 naming the exit. Idle: no collective is under
    way to notice the loss, yet /health says so within seconds (the HTTP process watches every rank).
    Busy holds its load until the kill (`hold`): both ranks stall their first streamed forward after its
    first layer groups, so decode's 2 running slots wait on KV and every other request waits for its
    destination; how long decode's 2 slots alone keep them there is how fast the machine decodes.
    The 2 rooms mid-transfer fail on decode with pages the dead rank never says it is done writing, and
    the instance's bootstrap server still answers: decode frees them after its quarantine limit (by
    default 4 waiting timeouts), here shortened."""
    release = tmp_path / "release"  # prefill stalls streamed forwards while it does not exist
    release.touch()
    prefill_flags = (*LAYERWISE, *HOLD["prefill_flags"], "--tp-size", "2")
    decode_flags = (*HOLD["decode_flags"], "--quarantine-timeout", f"{scaled(QUARANTINE_S):g}")
    stack = PDStack(
        mqa_model, *FLAGS, prefill_flags=prefill_flags, decode_flags=decode_flags, env=stall_env(release)
    ).wait_healthy()
    try:
        ranks = rank_processes(stack.prefill)
        assert len(ranks) == 2, ranks
        if moment == "busy":
            with cf.ThreadPoolExecutor(24) as pool:
                futures = hold(stack, release, 24, pool)  # each one waits on prefill until it is released
                ranks[-1].kill()
                release.touch()  # the surviving rank's forward goes on, into a collective with a dead peer
                results = outcomes(futures)  # every request ended, some with a clean 5xx error
            errors = [r for r in results if r[0] == "error"]
            assert len(errors) >= HELD // 2, results
            assert any("exited unexpectedly" in r[2] for r in errors), errors[:3]
        else:
            ranks[-1].kill()

        def prefill_says_why() -> bool:
            health = requests.get(f"{stack.prefill.url}/health", timeout=scaled(5))
            return health.status_code == 503 and "exited unexpectedly" in health.json()["reason"]

        wait_until(prefill_says_why, timeout=5, interval=0.1, what="prefill's /health naming the dead rank")

        def router_unready() -> bool:
            return requests.get(f"{stack.router.url}/health", timeout=scaled(5)).status_code == 503

        wait_until(router_unready, timeout=10, interval=0.1, what="the router taking prefill out of rotation")
        start = time.monotonic()
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        r = requests.post(f"{stack.router.url}/v1/completions", json=body, timeout=scaled(30))
        assert r.status_code == 503 and r.json()["error"]["message"], r.text
        assert time.monotonic() - start < scaled(5), "a request with no healthy pair must be refused at once"
        assert_clean(stack.decode.url)
    finally:
        release.touch()  # a stalled forward must not hold up the stop
        stack.stop()
