"""A failure between the legs of a P/D request: the prefill holding it dies after decode reserved its pages.

Two prefills and one decode behind a router. A long prompt keeps its prefill computing for a while after decode has
preallocated; the prefill is then killed. The router sees its leg fail, cancels decode's at once (decode frees the
pages then, not at its waiting timeout) and sends the request to the other prefill with the same decode: the client
gets its answer, the retry is counted, and decode never holds the pages of both attempts.
"""

from __future__ import annotations

import random
import re
import threading
import time

import pytest
import requests

from tests.integration.procs import PDStack, idle_and_flushed, scaled, wait_until

pytestmark = pytest.mark.integration
PROMPT_TOKENS = 3000
PAGE = 16


@pytest.fixture(scope="module")
def stack(tiny_model):
    flags = ("--page-size", str(PAGE), "--max-total-tokens", "32768")
    # Prefill computes the prompt 4 tokens a forward (750 forwards): seconds, against scheduler reports 0.5 s apart,
    # so that the prefill a report shows computing is still computing when it is killed.
    slow = ("--chunk-size", "4", "--max-batch-tokens", "4")
    # Decode's waiting timeout far away: the retry's prefill computes the prompt again at that pace (over 8 s on a
    # loaded machine), and the failed attempt's pages must come back by the router's cancel, not by a timeout.
    patient = ("--waiting-timeout", f"{scaled(120):g}")
    s = PDStack(
        tiny_model,
        *flags,
        prefills=2,
        prefill_flags=slow,
        decode_flags=patient,
        router_flags=("--verify-interval", "0"),
    )
    s.wait_healthy()
    yield s
    s.stop()


def stats(url: str) -> dict:
    return requests.get(f"{url}/stats", timeout=scaled(5)).json()


def retries(stack: PDStack, side: str) -> float:
    text = requests.get(f"{stack.router.url}/metrics", timeout=scaled(5)).text
    found = re.search(rf'^disagg_router_retries_total\{{side="{side}"\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_prefill_killed_after_decode_preallocated_frees_decode_and_the_request_is_answered_by_the_other(stack):
    prompt = [random.Random(3).randrange(10, 2000) for _ in range(PROMPT_TOKENS)]
    one_request = -(-(PROMPT_TOKENS + 20) // PAGE)  # pages decode holds for it
    before = retries(stack, "prefill")
    answer: dict = {}

    def ask() -> None:
        body = {"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
        r = requests.post(f"{stack.router.url}/v1/completions", json=body, timeout=scaled(120))
        answer.update(status=r.status_code, body=r.json(), at=time.monotonic())

    client = threading.Thread(target=ask)
    client.start()

    def holder() -> list[int] | None:
        """[the index of the prefill computing the prompt], once decode holds its pages."""
        if not stats(stack.decode.url).get("pages_used"):
            return None
        computing = [i for i, p in enumerate(stack.prefills) if stats(p.url).get("queues", {}).get("prefill_forward")]
        return computing or None

    [i] = wait_until(holder, interval=0.02, what="decode holding pages while a prefill computes the prompt")
    stack.prefills[i].kill()
    most = 0
    while client.is_alive():
        most = max(most, stats(stack.decode.url).get("pages_used", 0))
        time.sleep(0.05)
    client.join()

    assert answer["status"] == 200, answer
    assert answer["body"]["usage"]["completion_tokens"] == 20
    assert retries(stack, "prefill") == before + 1
    assert most < 2 * one_request, f"decode held {most} pages: the failed attempt's were not freed first"
    report = idle_and_flushed(stack.decode.url)
    assert report["pages_used"] == 0
    stack.prefills[i] = stack.start_prefill(stack.prefills[i].port, stack.bootstrap_ports[i]).wait_healthy()
