"""Prefill/decode disaggregation on one GPU: a prefill and a decode instance, each its own process on the one
CUDA device, behind the router, KV moved by Mooncake over TCP straight from device memory. Greedy answers through
the router equal a monolithic server's on the same GPU, for prompts sent whole, prompts prefilled in several
32-token chunks (the longer ones streamed layer by layer), and many concurrent prompts on a decode instance
whose pool is kept small (--max-total-tokens on decode alone).

Not shown here: a fragmented destination (decode's pages in many short runs, which the backend stages). Its
allocator takes the lowest free run that fits, and on the CPU this stack's concurrent requests never left a
prompt without one (every room was written in place); the staged path is covered by
tests/integration/test_mooncake_transfer.py, on the CPU only.

Skipped, saying why, where torch sees no CUDA device (conftest.py) or where the installed Mooncake build cannot
read device memory (the check by which the worker itself refuses `--device cuda`)."""

from __future__ import annotations

import concurrent.futures as cf

import pytest

from disagg_worker.config import DisaggConfig, Role
from disagg_worker.disagg.mooncake.environ import device_problem
from tests.integration.procs import PDStack, serve
from tests.integration.test_pd import LAYERWISE, assert_clean
from tests.integration.test_server import generate, varied_prompts

DEVICE = "cuda"
FLAGS = ("--device", DEVICE, "--page-size", "4", "--chunk-size", "32", "--max-total-tokens", "8192")
# 192 pages of 4 tokens: the longest of `varied_prompts` with its answer takes 56, so every request fits, and 16 at
# once make decode wait for pages and reuse freed ones.
TIGHT = ("--max-total-tokens", "768")


@pytest.fixture(scope="module")
def mooncake_on_device() -> None:
    """Skips the module where the installed Mooncake cannot read device memory; imports its engine first, so that
    a build that cannot load says why here rather than as a server that never starts."""
    if problem := device_problem(DisaggConfig(role=Role.PREFILL, transfer_backend="mooncake"), DEVICE):
        pytest.skip(problem)
    import mooncake.engine  # noqa: F401


@pytest.fixture(scope="module")
def mono(mooncake_on_device, tiny_model):
    p = serve(tiny_model, "--served-model-name", "tiny", *FLAGS).wait_healthy()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def stack(mooncake_on_device, tiny_model):
    s = PDStack(tiny_model, *FLAGS, prefill_flags=LAYERWISE, decode_flags=TIGHT).wait_healthy()
    yield s
    s.stop()


def test_short_prompts_sent_whole_equal_monolithic(stack, mono):
    prompts = [p for p in varied_prompts(24) if len(p) <= 32][:6]
    assert prompts
    assert [generate(stack.router.url, p) for p in prompts] == [generate(mono.url, p) for p in prompts]
    assert_clean(stack.prefill.url, stack.decode.url)


def test_chunked_prefill_equals_monolithic(stack, mono):
    prompts = [p for p in varied_prompts(24) if len(p) > 64][:6]
    assert len(prompts) >= 3
    assert [generate(stack.router.url, p) for p in prompts] == [generate(mono.url, p) for p in prompts]
    assert_clean(stack.prefill.url, stack.decode.url)


def test_concurrent_requests_on_a_small_decode_pool_equal_monolithic(stack, mono):
    prompts = varied_prompts(48)
    expected = [generate(mono.url, p) for p in prompts]
    with cf.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda p: generate(stack.router.url, p), prompts))
    assert got == expected
    assert_clean(stack.prefill.url, stack.decode.url)
