"""The router proves the prefill->decode path before and while it uses it: real prefill and decode processes, real
bootstrap and Mooncake TCP transfers, routers with fast verification settings."""

from __future__ import annotations

import os
import signal
import time

import pytest
import requests

from tests.integration.procs import FAST_FAILURE, Proc, free_port, scaled, wait_until
from tests.integration.test_pd import FLAGS

pytestmark = pytest.mark.integration
# A probe of a healthy pair may take longer on a loaded machine: its timeout is scaled, the interval is not.
VERIFY = ["--verify-interval", "2", "--verify-timeout", f"{scaled(15):g}", "--health-interval", "0.5"]


class Workers:
    """One prefill and two decode instances of revision r1, named as pods would be."""

    def __init__(self, model: str):
        self.model = model
        self.bootstrap_port = free_port()
        flags = [*FLAGS, *FAST_FAILURE]
        self.prefill = self.start(
            "prefill", "m-prefill-0", "r1", [*flags, "--bootstrap-port", str(self.bootstrap_port)]
        )
        self.decodes = [self.start("decode", f"m-decode-{i}", "r1", flags) for i in range(2)]
        for w in (self.prefill, *self.decodes):
            w.wait_healthy()

    def start(self, role: str, pod: str, revision: str, flags: list[str]) -> Proc:
        port = free_port()
        env = {"DISAGG_POD_NAME": pod, "DISAGG_REVISION": revision}
        return Proc([role, "--model", self.model, "--port", str(port), *flags], port, env)

    def router(self, decodes: list[Proc], bootstrap_port: int | None = None) -> Proc:
        port = free_port()
        args = [
            "router",
            "--port",
            str(port),
            "--prefill",
            self.prefill.url,
            str(bootstrap_port or self.bootstrap_port),
        ]
        for d in decodes:
            args += ["--decode", d.url]
        return Proc([*args, *VERIFY], port)

    def stop(self) -> None:
        for w in (self.prefill, *self.decodes):
            w.stop()


@pytest.fixture(scope="module")
def workers(tiny_model):
    w = Workers(tiny_model)
    yield w
    w.stop()


def answering(router: Proc) -> bool:
    try:
        requests.get(f"{router.url}/livez", timeout=scaled(2))
    except requests.RequestException:
        return False
    return True


def health(router: Proc) -> tuple[int, dict]:
    r = requests.get(f"{router.url}/health", timeout=scaled(5))
    return r.status_code, r.json()


def ready(router: Proc) -> tuple[int, dict]:
    """The readiness probe the router's pods use."""
    r = requests.get(f"{router.url}/ready", timeout=scaled(5))
    return r.status_code, r.json()


def pairs(router: Proc) -> dict[tuple[str, str], dict]:
    return {(p["prefill"], p["decode"]): p for p in health(router)[1].get("pairs", [])}


def complete(router: Proc) -> requests.Response:
    body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    return requests.post(f"{router.url}/v1/completions", json=body, timeout=scaled(30))


def counter(worker: Proc, name: str) -> float:
    text = requests.get(f"{worker.url}/metrics", timeout=scaled(5)).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"{name}{{"))


def test_healthy_workers_are_not_enough_the_router_is_ready_only_with_a_verified_pair(workers):
    # Told the wrong bootstrap port, the router sees two healthy workers whose handoff cannot work.
    broken = workers.router(workers.decodes[:1], bootstrap_port=free_port())
    try:
        wait_until(lambda: answering(broken), 30, what="the router answering")
        wait_until(
            lambda: (
                pairs(broken).get(("m-prefill-0", "m-decode-0"), {}).get("error", "").startswith(("decode", "prefill"))
            ),
            40,
            what="a failed verification",
        )
        status, body = health(broken)
        assert status == 503 and body["status"] == "unhealthy"
        # Never Ready either: a new replica without a pair must not take an old one's place in the Service.
        not_ready = ready(broken)
        assert not_ready[0] == 503 and "m-prefill-0 -> m-decode-0: " in not_ready[1]["reason"], not_ready
        assert all(w["healthy"] for w in body["workers"])
        pair = pairs(broken)[("m-prefill-0", "m-decode-0")]
        assert pair["verified"] is False and pair["revision"] == "r1" and pair["age_s"] is not None
        start = time.monotonic()
        r = complete(broken)
        assert r.status_code == 503 and time.monotonic() - start < scaled(5), r.text
    finally:
        broken.stop()
    router = workers.router(workers.decodes[:1]).wait_healthy(60)
    try:
        pair = pairs(router)[("m-prefill-0", "m-decode-0")]
        assert pair["verified"] is True and pair["error"] == ""
        assert ready(router) == (200, {"status": "ok", "pair": True})
        decode = workers.decodes[0]
        before = counter(decode, "disagg_requests_total"), counter(decode, "disagg_probe_requests_total")
        wait_until(lambda: counter(decode, "disagg_probe_requests_total") >= before[1] + 2, 20, what="two more probes")
        assert counter(decode, "disagg_requests_total") == before[0], "probes are not user requests"
        assert complete(router).status_code == 200
        assert counter(decode, "disagg_requests_total") == before[0] + 1
    finally:
        router.stop()


def test_a_frozen_decode_leaves_rotation_within_10_s_and_comes_back(workers):
    a, b = workers.decodes
    router = workers.router([a, b]).wait_healthy(60)
    try:
        wait_until(
            lambda: all(p["verified"] for p in pairs(router).values()) and len(pairs(router)) == 2,
            30,
            what="both pairs verified",
        )
        served_by_b = counter(b, "disagg_requests_total")
        os.killpg(b.proc.pid, signal.SIGSTOP)
        try:
            frozen = time.monotonic()
            wait_until(
                lambda: not pairs(router)[("m-prefill-0", "m-decode-1")]["verified"],
                10,
                interval=0.2,
                what="the frozen pair failed",
            )
            assert time.monotonic() - frozen < scaled(10)
            assert health(router)[0] == 200, "the other pair still serves"
            assert all(complete(router).status_code == 200 for _ in range(6))
            os.killpg(a.proc.pid, signal.SIGSTOP)
            try:
                wait_until(lambda: health(router)[0] == 503, 10, interval=0.2, what="no verified pair on /health")
                # Still Ready: it stays in its Service and refuses at once, with Retry-After; why is in its log.
                assert ready(router) == (200, {"status": "ok", "pair": False})
                start = time.monotonic()
                r = complete(router)
                assert r.status_code == 503 and time.monotonic() - start < scaled(5)
                message = r.json()["error"]["message"]
                assert r.headers.get("Retry-After") and "No healthy prefill/decode pair" in message
                assert "http" not in message and "127.0.0.1" not in message, "a client is told no worker's address"
            finally:
                os.killpg(a.proc.pid, signal.SIGCONT)
        finally:
            os.killpg(b.proc.pid, signal.SIGCONT)
        wait_until(
            lambda: health(router)[0] == 200 and all(p["verified"] for p in pairs(router).values()),
            40,
            what="both pairs verified again",
        )
        assert counter(b, "disagg_requests_total") == served_by_b, "no user request went to the frozen decode"
    finally:
        router.stop()


def test_pairs_form_only_between_workers_of_the_same_revision(workers):
    newer = workers.start("decode", "m-decode-9", "r2", [*FLAGS, *FAST_FAILURE]).wait_healthy()
    router = workers.router([workers.decodes[0], newer]).wait_healthy(60)
    try:
        wait_until(lambda: pairs(router).get(("m-prefill-0", "m-decode-0"), {}).get("verified"), 30, what="the r1 pair")
        assert set(pairs(router)) == {("m-prefill-0", "m-decode-0")}
        revisions = {w["pod"]: w["revision"] for w in health(router)[1]["workers"]}
        assert revisions == {"m-prefill-0": "r1", "m-decode-0": "r1", "m-decode-9": "r2"}
        assert all(complete(router).status_code == 200 for _ in range(4))
        assert counter(newer, "disagg_requests_total") == 0
    finally:
        router.stop()
        newer.stop()
