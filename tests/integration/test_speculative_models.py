"""Speculative decoding with a draft model (EAGLE with a random head, STANDALONE with a small random draft of the
model's tokenizer and KV shape) through real servers: the same tokens as a plain server, monolithic and
through router + prefill + decode over Mooncake TCP, where the draft's KV moves with the model's pages (bytes
counted at the Mooncake layer) and a prefill and a decode that disagree on the draft are refused by name. On
SmolLM2-135M-Instruct (`real_model`) the same chat answers greedy and seeded, for both kinds and both paths.

The random drafts are rarely right, so these tests check exactness and what moves, not speed: the draft
counter shows they drafted (`bench/bench_speculative.py` measures speed)."""

from __future__ import annotations

import re
import subprocess

import pytest
import requests

from disagg_worker.model.demo import SERVED_NAME
from disagg_worker.model.eagle import make_eagle_head
from disagg_worker.model.tiny import make_draft
from tests.integration.procs import DISAGG, PDStack, Proc, scaled, serve, wait_until
from tests.integration.test_pd import FLAGS, LAYERWISE, assert_clean
from tests.integration.test_speculative import answers, generate_all, plain_tokens, repetitive_prompts

pytestmark = pytest.mark.integration
STEPS = ("--speculative-num-steps", "3")  # page size 4: three drafts and the last known token fill a page


def spec_flags(algorithm: str, path: str) -> tuple[str, ...]:
    return ("--speculative-algorithm", algorithm, "--speculative-draft-model-path", path, *STEPS)


def metric(url: str, name: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=scaled(10)).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


@pytest.fixture(scope="module")
def drafts(tiny_model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("drafts")
    return {
        "EAGLE": str(make_eagle_head(tiny_model, root / "eagle")),
        "STANDALONE": str(make_draft(tiny_model, root / "small")),
    }


@pytest.mark.parametrize("algorithm", ["EAGLE", "STANDALONE"])
def test_draft_model_answers_are_the_plain_ones_and_its_kv_moves_with_the_pages(tiny_model, drafts, algorithm):
    prompts = repetitive_prompts(8)
    expected = plain_tokens(tiny_model, prompts)
    flags = spec_flags(algorithm, drafts[algorithm])
    mono = serve(tiny_model, *FLAGS, *flags)
    # No pairing probes: each would move a one-token prompt's page and blur the byte count. Prefill streams the
    # model's layers of prompts of 40+ tokens; the draft's layers leave with the send after the step.
    stack = PDStack(tiny_model, *FLAGS, *flags, prefill_flags=LAYERWISE, router_flags=("--verify-interval", "0"))
    try:
        mono.wait_healthy(), stack.wait_healthy()
        assert generate_all(mono.url, prompts) == expected
        assert generate_all(stack.router.url, prompts) == expected
        for url in (mono.url, stack.decode.url):
            wait_until(lambda u=url: metric(u, "disagg_spec_draft_tokens_total") > 0, 10, what="drafts verified")
        assert metric(stack.prefill.url, "disagg_spec_draft_tokens_total") == 0  # prefill never verifies
        assert_clean(mono.url, stack.prefill.url, stack.decode.url)
        # Whole pages of 4 tokens, per layer K and V of 2 heads x 32 float32 values: the model's 4 layers and
        # the draft's one (the EAGLE head's layer; the one-layer STANDALONE draft of the same KV shape).
        pages = sum(-(-len(p) // 4) for p in prompts)
        want = pages * (4 + 1) * 2 * 4 * 2 * 32 * 4
        got = wait_until(
            lambda: (b := metric(stack.prefill.url, "disagg_kv_transfer_bytes_total")) >= want and b,
            10,
            what="bytes counted",
        )
        assert got == want
        groups = "disagg_kv_layer_group_send_seconds_count"  # the prompts of 40+ tokens streamed
        wait_until(lambda: metric(stack.prefill.url, groups) > 0, 10, what="layer groups streamed")
    finally:
        mono.stop()
        stack.stop()


def test_a_prefill_and_a_decode_that_disagree_on_the_draft_are_refused_by_name(tiny_model, drafts):
    stack = PDStack(
        tiny_model, *FLAGS, prefill_flags=spec_flags("EAGLE", drafts["EAGLE"]), router_flags=("--verify-interval", "0")
    ).wait_healthy()
    try:
        body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        r = requests.post(f"{stack.router.url}/generate", json=body, timeout=scaled(60))
        assert r.status_code == 500, r.text  # the deployment's fault, not the request's: a server error, named
        assert "speculative decoding differs: prefill keeps draft KV EAGLE" in r.text, r.text
        assert "decode none" in r.text, r.text
    finally:
        stack.stop()


# ---- SmolLM2 ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """SmolLM2 (float32 directory), its random EAGLE head and its small random STANDALONE draft."""
    root = tmp_path_factory.mktemp("smol")
    model = root / SERVED_NAME
    subprocess.run([DISAGG, "model", "convert-gguf", "--out", str(model)], check=True, timeout=scaled(300))
    return {
        "model": str(model),
        "EAGLE": str(make_eagle_head(model, root / "eagle")),
        "STANDALONE": str(make_draft(model, root / "small")),
    }


@pytest.mark.real_model
@pytest.mark.parametrize("algorithm", ["EAGLE", "STANDALONE"])
def test_smollm2_answers_the_same_with_a_draft_model_monolithic_and_through_pd(smol, algorithm):
    model, flags = (
        smol["model"],
        ("--speculative-algorithm", algorithm, "--speculative-draft-model-path", smol[algorithm]),
    )
    started: list[Proc | PDStack] = []
    try:
        started.append(serve(model, "--served-model-name", "tiny"))
        started.append(serve(model, "--served-model-name", "tiny", *flags))
        started.append(PDStack(model, *flags))
        plain, spec = (p.wait_healthy(timeout=300) for p in started[:2])
        stack = started[2]
        assert isinstance(stack, PDStack)
        stack.wait_healthy()
        for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 11}):
            want = answers(plain.url, **sampling)
            assert answers(spec.url, **sampling) == want, sampling
            assert answers(stack.router.url, **sampling) == want, sampling
        for url in (spec.url, stack.decode.url):
            wait_until(lambda u=url: metric(u, "disagg_spec_draft_tokens_total") > 0, 10, what="drafts verified")
    finally:
        for p in started:
            p.stop()
