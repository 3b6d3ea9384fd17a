"""Instances whose ranks span pods, as real processes on one machine: pod 0 of an instance (`--node-rank 0`) runs
rank 0, the HTTP front end and the bootstrap server, the other pod (`--node-rank 1`) only its ranks; they meet
over TCP at `--dist-init-addr`. Through the router the greedy tokens equal a single-rank server's; killing the
other pod's process fails the instance (503 on pod 0's /health) within seconds, and the group restarted serves
again."""

from __future__ import annotations

import time

import pytest
import requests

from tests.integration.procs import PDStack, Proc, free_port, scaled, wait_until
from tests.integration.test_pd import FLAGS, assert_clean
from tests.integration.test_speculative import generate_all, plain_tokens, repetitive_prompts

pytestmark = pytest.mark.integration


def two_pods(ranks: tuple[str, ...]) -> tuple[str, ...]:
    """Pod 0's flags for an instance of `ranks` over two pods meeting at a fresh port."""
    return (*ranks, "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", f"127.0.0.1:{free_port()}")


def other_pod(stack: PDStack, role: str, flags: tuple[str, ...]) -> Proc:
    """Pod 1 of the instance whose pod 0 got `flags`: the same command line, node rank 1, its own port."""
    port = free_port()
    args = [role, "--model", stack.model, "--port", str(port), *stack.flags, *flags]
    args[args.index("--node-rank") + 1] = "1"
    if role == "prefill":
        args += ["--bootstrap-port", str(stack.bootstrap_port)]
    return Proc(args, port)


CASES = {
    "prefill-tp2-over-two-pods": (("--tp-size", "2"), None),
    "both-pp2-over-two-pods": (("--pp-size", "2"), ("--pp-size", "2")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_instance_over_two_pods_answers_as_one_rank_does(tiny_model, case):
    prefill_ranks, decode_ranks = CASES[case]
    prompts = repetitive_prompts(8)
    expected = plain_tokens(tiny_model, prompts)
    prefill_flags = two_pods(prefill_ranks)
    decode_flags = two_pods(decode_ranks) if decode_ranks else ()
    stack = PDStack(tiny_model, *FLAGS, prefill_flags=prefill_flags, decode_flags=decode_flags)
    pods = [other_pod(stack, "prefill", prefill_flags)]
    if decode_ranks:
        pods.append(other_pod(stack, "decode", decode_flags))
    try:
        stack.wait_healthy()
        for pod in pods:
            pod.wait_healthy()
            assert requests.get(f"{pod.url}/health", timeout=scaled(5)).json()["ranks"] == [1]
        assert generate_all(stack.router.url, prompts) == expected
        assert_clean(stack.prefill.url, stack.decode.url)
    finally:
        for pod in pods:
            pod.stop()
        stack.stop()


def test_a_pod_lost_fails_the_instance_within_seconds_and_the_group_restarted_serves(tiny_model):
    prompts = repetitive_prompts(3)
    expected = plain_tokens(tiny_model, prompts)
    flags = two_pods(("--tp-size", "2"))
    stack = PDStack(tiny_model, *FLAGS, prefill_flags=flags)
    pod = other_pod(stack, "prefill", flags)
    try:
        stack.wait_healthy()
        pod.wait_healthy()
        assert generate_all(stack.router.url, prompts) == expected
        killed = time.monotonic()
        pod.proc.kill()  # the pod's process, and with it its rank (the parent-death signal)
        wait_until(
            lambda: requests.get(f"{stack.prefill.url}/health", timeout=scaled(5)).status_code == 503,
            10,
            what="pod 0's /health failing",
        )
        took = time.monotonic() - killed
        body = requests.get(f"{stack.prefill.url}/health", timeout=scaled(5)).text
        assert "exited unexpectedly" in body, body
        # Idle ranks meet every second: the lost rank breaks the next meeting (no request needed).
        assert took < scaled(5), took
        # The group restarts as one, on the same ports: it serves again through the same router.
        stack.prefill.stop()
        stack.prefill = stack.start_prefill(port=stack.prefill.port)
        pod = other_pod(stack, "prefill", flags)
        stack.prefill.wait_healthy(), pod.wait_healthy()
        body = {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        wait_until(  # the router takes the restarted prefill back once its health checks pass
            lambda: requests.post(f"{stack.router.url}/generate", json=body, timeout=scaled(30)).ok,
            60,
            interval=1,
            what="a request through the restarted group",
        )
        assert generate_all(stack.router.url, prompts) == expected
    finally:
        pod.stop()
        stack.stop()
