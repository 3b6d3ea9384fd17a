"""DeepSeek-class models served as users run them: tiny random DeepSeek-V3 (MLA with and without a
q low-rank projection, YaRN, grouped sigmoid routing with shared experts) and Qwen3-MoE, greedy tokens
equal to transformers' through a monolithic server, through tensor-parallel ranks and through P/D in
every TP pairing, with the latent KV moved once per decode rank and every page freed afterwards."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import torch
import transformers

from disagg_worker.model.tiny import make_tiny
from tests.integration.procs import PDStack, reference, report_after, scaled, serve, wait_until
from tests.integration.test_parallel import concurrently
from tests.integration.test_pd import FLAGS, LAYERWISE, SCHEMA, assert_clean, metric, structured
from tests.integration.test_pd_faults import request
from tests.integration.test_server import generate, varied_prompts

pytestmark = pytest.mark.integration
NEW_TOKENS = 12  # generate()'s default: what test_parallel.concurrently asks for
DP2 = ("--enable-dp-attention", "--dp-size", "2")
# A second DeepSeek-V3 shape: queries by one projection, no YaRN, rotary halves not interleaved, one expert
# group, two shared experts, every layer MoE, 8 heads (two tensor ranks hold 4 each), v_head_dim != nope dim.
WIDE = {
    "q_lora_rank": None,
    "rope_scaling": None,
    "rope_interleave": False,
    "n_group": 1,
    "topk_group": 1,
    "n_shared_experts": 2,
    "first_k_dense_replace": 0,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 24,
    "kv_lora_rank": 48,
    "qk_rope_head_dim": 8,
    "num_experts_per_tok": 3,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("moe")
    return {
        "deepseek_v3": str(make_tiny(root / "deepseek_v3", arch="deepseek_v3")),
        "deepseek_v3_wide": str(make_tiny(root / "deepseek_v3_wide", arch="deepseek_v3", overrides=WIDE)),
        "qwen3_moe": str(make_tiny(root / "qwen3_moe", arch="qwen3_moe")),
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Varied lengths, several over one prefill chunk (32), one repeated prefix (the prefix cache)."""
    out = varied_prompts(12)
    assert sum(len(p) > 32 for p in out) >= 3
    return out


_expected: dict[str, list[list[int]]] = {}


def transformers_greedy(path: str, prompts: list[list[int]]) -> list[list[int]]:
    """The reference's greedy tokens (recomputed over the whole sequence each step; EOS ignored)."""
    if path not in _expected:
        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        outs = []
        with torch.no_grad():
            for p in prompts:
                ids = list(p)
                for _ in range(NEW_TOKENS):
                    ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
                outs.append(ids[len(p) :])
        _expected[path] = outs
    return _expected[path]


def kv_bytes_moved(url: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=scaled(5)).text
    return sum(float(v) for v in re.findall(r"^disagg_kv_transfer_bytes_total\{[^}]*\} (\S+)$", text, re.M))


@pytest.mark.parametrize(
    "name,flags",
    [
        ("deepseek_v3", ()),
        ("deepseek_v3_wide", ()),
        ("qwen3_moe", ()),
        ("deepseek_v3_wide", ("--tp-size", "2")),
        ("qwen3_moe", ("--tp-size", "2")),
        ("deepseek_v3", ("--tp-size", "2", "--ep-size", "2")),
        ("qwen3_moe", ("--tp-size", "2", "--ep-size", "2")),
        ("deepseek_v3", ("--tp-size", "2", *DP2)),
        ("deepseek_v3_wide", ("--tp-size", "2", "--ep-size", "2", *DP2)),
        ("qwen3_moe", ("--tp-size", "2", *DP2)),
        ("deepseek_v3_wide", ("--tp-size", "4", *DP2)),
    ],
    ids=[
        "deepseek",
        "deepseek-wide",
        "qwen3-moe",
        "deepseek-wide-tp2",
        "qwen3-moe-tp2",
        "deepseek-ep2",
        "qwen3-moe-ep2",
        "deepseek-dp2",
        "deepseek-wide-dp2-ep2",
        "qwen3-moe-dp2",
        "deepseek-wide-tp4-dp2",  # two ranks per attention group: heads split and summed within each group
    ],
)
def test_monolithic_greedy_is_transformers_greedy(models, prompts, name, flags):
    expected = transformers_greedy(models[name], prompts)
    server = serve(models[name], *FLAGS, *flags).wait_healthy()
    try:
        assert concurrently(server.url, prompts) == expected
        assert_clean(server.url)
        if "--enable-dp-attention" in flags:
            assert_every_group_served(server.url, 2)
    finally:
        server.stop()


def assert_every_group_served(url: str, groups: int) -> None:
    """Each attention group of a DP-attention instance scheduled requests of its own (as a report made after the
    caller's requests ended says: each group reports twice a second)."""
    st = report_after(url, time.time(), lambda st: len(st.get("groups", [])) == groups, 10, "every group reported")
    assert [g["dp_rank"] for g in st["groups"]] == list(range(groups)), st
    assert all(g["step_count"] > 0 for g in st["groups"]), st["groups"]


def test_dp_attention_serves_a_request_while_the_other_group_is_idle(models, prompts):
    """A request pinned to either group answers as transformers does while the other group has nothing (it still
    joins every forward's MoE collectives, over no tokens); a group that does not exist is a 400 naming it."""
    model = models["deepseek_v3"]
    expected = transformers_greedy(model, prompts)
    server = serve(model, *FLAGS, "--tp-size", "2", *DP2).wait_healthy()
    try:
        for group in (1, 0, 1):
            body = {"input_ids": prompts[0], "data_parallel_rank": group}
            body["sampling_params"] = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
            r = requests.post(f"{server.url}/generate", json=body, timeout=scaled(60))
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == expected[0]
        assert_every_group_served(server.url, 2)
        r = requests.post(f"{server.url}/generate", json={**body, "data_parallel_rank": 2}, timeout=scaled(10))
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "data_parallel_rank 2: this instance runs 2 attention groups"
        assert_clean(server.url)
    finally:
        server.stop()


# Prefill streams the latent of prompts of 40+ tokens layer by layer in every pairing but tp1-tp1 (which sends
# every prompt whole): the one-sender rule and the attention groups hold for the streamed groups too.
PAIRINGS = {
    "tp1-tp1": ((), ()),
    "prefill-tp2-decode-tp1": (("--tp-size", "2", *LAYERWISE), ()),
    "prefill-tp1-decode-tp2": (LAYERWISE, ("--tp-size", "2")),
    "decode-ep2": (LAYERWISE, ("--tp-size", "2", "--ep-size", "2")),
    "prefill-tp2-dp2-decode-tp1": (("--tp-size", "2", *DP2, *LAYERWISE), ()),
    "prefill-tp1-decode-tp2-dp2": (LAYERWISE, ("--tp-size", "2", *DP2)),
    # Groups of two ranks on prefill: the group's ranks agree on each transfer, one of them sends each latent.
    "prefill-tp4-dp2-decode-tp1": (("--tp-size", "4", *DP2, *LAYERWISE), ()),
}


def attention_ranks(flags: tuple[str, ...]) -> int:
    """The ranks of one attention group of an instance started with `flags` (its TP size without DP attention)."""
    size = {f: int(v) for f, v in zip(flags, flags[1:], strict=False) if f in ("--tp-size", "--dp-size")}
    return size.get("--tp-size", 1) // size.get("--dp-size", 1)


@pytest.mark.parametrize("pairing", list(PAIRINGS))
def test_pd_greedy_is_transformers_greedy_and_the_latent_moves_once_per_decode_rank(models, prompts, pairing):
    model = models["deepseek_v3_wide"]
    prefill_flags, decode_flags = PAIRINGS[pairing]
    expected = transformers_greedy(model, prompts)
    # No pairing probes: each moves a one-token prompt's page, which would blur the byte count.
    stack = PDStack(
        model, *FLAGS, prefill_flags=prefill_flags, decode_flags=decode_flags, router_flags=("--verify-interval", "0")
    ).wait_healthy()
    try:
        assert concurrently(stack.router.url, prompts) == expected
        assert_clean(stack.prefill.url, stack.decode.url)
        # Whole pages move: 4 tokens of 4 layers x (48 + 8) float32 latent values, once to each rank of the decode
        # attention group that runs the request.
        pages = sum(-(-len(p) // 4) for p in prompts)
        want = pages * 4 * 4 * (48 + 8) * 4 * attention_ranks(decode_flags)
        # Counted just after each transfer's Success: wait for the sum, then check it is not more.
        got = wait_until(lambda: (b := kv_bytes_moved(stack.prefill.url)) >= want and b, 10, what="bytes counted")
        assert got == want
        if LAYERWISE[0] in prefill_flags:
            groups = "disagg_kv_layer_group_send_seconds_count"
            wait_until(lambda: metric(stack.prefill.url, groups) > 0, 10, what="layer groups streamed")
        for url, flags in ((stack.prefill.url, prefill_flags), (stack.decode.url, decode_flags)):
            if "--enable-dp-attention" in flags:  # the router spread the requests over the groups
                assert_every_group_served(url, 2)
    finally:
        stack.stop()


def test_pd_with_dp_attention_on_both_sides_answers_as_transformers_and_its_pairs_verify(models, prompts):
    """Prefill and decode each TP2 as two attention groups, the router verifying pairs with probes (each probe in
    the groups its room picks), prefill streaming prompts of 40+ tokens layer by layer: greedy tokens as
    transformers', every group of both sides served."""
    model = models["deepseek_v3"]
    expected = transformers_greedy(model, prompts)
    both = ("--tp-size", "2", *DP2)
    stack = PDStack(model, *FLAGS, prefill_flags=(*both, *LAYERWISE), decode_flags=both).wait_healthy()
    try:
        assert concurrently(stack.router.url, prompts) == expected
        assert_clean(stack.prefill.url, stack.decode.url)
        for url in (stack.prefill.url, stack.decode.url):
            assert_every_group_served(url, 2)
        groups = "disagg_kv_layer_group_send_seconds_count"  # prompts of 40+ tokens streamed from both groups
        wait_until(lambda: metric(stack.prefill.url, groups) > 0, 10, what="layer groups streamed")
        health = requests.get(f"{stack.decode.url}/health", timeout=scaled(5)).json()
        assert health["dp_loads"] == [0, 0]
    finally:
        stack.stop()


def test_pd_qwen3_moe_greedy_is_transformers_greedy(models, prompts):
    expected = transformers_greedy(models["qwen3_moe"], prompts)
    stack = PDStack(models["qwen3_moe"], *FLAGS).wait_healthy()
    try:
        assert concurrently(stack.router.url, prompts) == expected
        assert_clean(stack.prefill.url, stack.decode.url)
    finally:
        stack.stop()


def routed_tokens(url: str) -> dict[tuple[str, str], float]:
    text = requests.get(f"{url}/metrics", timeout=scaled(5)).text
    found = re.findall(r'^disagg_moe_routed_tokens_total\{ep_rank="(\d+)",expert="(\d+)"\} (\S+)$', text, re.M)
    return {(expert, rank): float(n) for rank, expert, n in found}


def test_expert_load_is_reported_per_expert_and_the_rank_holding_it(models):
    """8 experts over 2 EP ranks: 0-3 on rank 0, 4-7 on rank 1; every token of every MoE layer picks 2."""
    server = serve(models["qwen3_moe"], *FLAGS, "--tp-size", "2", "--ep-size", "2").wait_healthy()
    try:
        generate(server.url, list(range(100, 140)), NEW_TOKENS)
        # 3 MoE layers (layer 0 is dense) x top-2, over the prompt's 40 tokens and each decode step's one (the
        # counts reach the metric with the scheduler's next report).
        want = 6 * (40 + NEW_TOKENS - 1)
        load = wait_until(lambda: (d := routed_tokens(server.url)) and sum(d.values()) >= want and d, 10, what="load")
        assert {rank for (_, rank) in load} == {"0", "1"}
        assert all(int(expert) // 4 == int(rank) for expert, rank in load)
        assert sum(load.values()) % 6 == 0, load
    finally:
        server.stop()


@pytest.mark.parametrize(
    "decode_flags",
    [("--tp-size", "2", "--ep-size", "2"), ("--tp-size", "2", "--ep-size", "2", *DP2)],
    ids=["decode-ep2", "decode-dp2-ep2"],
)
def test_1000_requests_aborted_at_random_stages_leave_no_latent_page_behind(models, decode_flags):
    """Prefill TP2 (one rank sends each latent, the other nothing) and decode TP2 with EP2 (and DP attention: two
    groups, each its own requests and pages): clients give up at random moments; afterwards every page of every
    rank (every group) on both sides is free and answers are unchanged."""
    stack = PDStack(
        models["deepseek_v3"], *FLAGS, prefill_flags=("--tp-size", "2"), decode_flags=decode_flags
    ).wait_healthy()
    try:
        before = reference(stack.router.url)
        rng = random.Random(0)
        timeouts = [rng.uniform(0.005, 0.6) for _ in range(1000)]
        with cf.ThreadPoolExecutor(48) as pool:
            futures = [
                pool.submit(request, stack.router.url, i, t, rng.choice([5, 40, 120]), 20)
                for i, t in enumerate(timeouts)
            ]
            results = [f.result(timeout=scaled(180)) for f in futures]
        assert {r[0] for r in results} <= {"ok", "error", "timeout"}
        assert sum(r[0] == "timeout" for r in results) > 100  # most were cut off by the client
        assert_clean(stack.prefill.url, stack.decode.url)
        assert reference(stack.router.url) == before
    finally:
        stack.stop()


def test_structured_output_seeded_sampling_and_logprobs_on_mla_equal_monolithic_through_pd(models):
    """What users ask of any model works on an MLA/MoE one: a JSON schema, seeded sampling and logprobs give the same
    answer through P/D (the first token and its logprobs travel from prefill) as from one server."""
    model = models["deepseek_v3"]
    mono = serve(model, *FLAGS, "--served-model-name", "tiny").wait_healthy()
    stack = PDStack(model, *FLAGS).wait_healthy()
    try:
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 4}):
            a, b = (structured(url, "Is the sky blue?", fmt, **sampling) for url in (mono.url, stack.router.url))
            assert a["message"]["content"] == b["message"]["content"]
            assert set(json.loads(a["message"]["content"])) == {"ok", "colour"}
        body = {"prompt": list(range(100, 160)), "max_tokens": 8, "temperature": 0, "logprobs": 3}
        got = [
            requests.post(f"{url}/v1/completions", json=body, timeout=scaled(60)).json()["choices"][0]
            for url in (mono.url, stack.router.url)
        ]
        assert got[0]["text"] == got[1]["text"]
        for x, y in zip(got[0]["logprobs"]["token_logprobs"], got[1]["logprobs"]["token_logprobs"], strict=True):
            assert abs(x - y) < 1e-4
    finally:
        stack.stop()
        mono.stop()


def test_an_unsupported_architecture_stops_the_start_up_naming_it(models, tmp_path):
    path = tmp_path / "v2"
    path.mkdir()
    for f in Path(models["deepseek_v3"]).iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(
        json.dumps({**cfg, "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"]})
    )
    out = subprocess.run(
        [sys.executable, "-m", "disagg_worker.cli", "serve", "--model", str(path), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "unsupported model architecture 'deepseek_v2'" in out.stderr, out.stderr


def test_a_dp_group_whose_scheduler_dies_fails_the_whole_instance_at_once(models):
    """Requests run in both attention groups; the second group's scheduler is killed: every request of either
    group ends with a 500 (instance_failed) naming the exit within a bound (the other group cannot step alone: its
    MLPs need the dead one), /health says why, and new requests are refused."""
    server = serve(models["deepseek_v3"], *FLAGS, "--tp-size", "2", *DP2).wait_healthy()
    try:
        body = {"input_ids": list(range(100, 120)), "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
        with cf.ThreadPoolExecutor(4) as pool:
            held = [
                pool.submit(
                    requests.post, f"{server.url}/generate", json={**body, "data_parallel_rank": g}, timeout=scaled(120)
                )
                for g in (0, 1, 0, 1)
            ]
            st = report_after(
                server.url,
                time.time(),
                lambda st: [g["running"] for g in st.get("groups", [])] == [2, 2],
                30,
                "two requests running in each group",
            )
            killed = time.monotonic()
            os.kill(st["groups"][1]["pid"], signal.SIGKILL)
            answers = [f.result(timeout=scaled(30)) for f in held]
            answered = time.monotonic()
        assert [a.status_code for a in answers] == [500] * 4
        assert all("scheduler process" in a.json()["error"]["message"] for a in answers)
        assert all(a.json()["error"]["code"] == "instance_failed" for a in answers)
        assert answered - killed < scaled(2.0), f"failed {answered - killed:.2f} s after the kill"
        health = requests.get(f"{server.url}/health", timeout=scaled(5))
        assert health.status_code == 503 and "exited unexpectedly" in health.json()["reason"]
        again = requests.post(f"{server.url}/generate", json=body, timeout=scaled(10))
        assert again.status_code == 503
    finally:
        server.stop()
