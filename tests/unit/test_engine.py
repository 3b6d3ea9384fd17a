"""The engine in-process: continuous batching, chunking, prefix cache, overlap, retraction, aborts.

Every test ends with the page accounting a user relies on: at idle, every page is free or held
unlocked by the prefix cache, and flushing the cache frees them all.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from disagg_worker.config import CacheConfig, EngineConfig, SchedulerConfig
from disagg_worker.engine.assemble import load_engine
from disagg_worker.engine.engine import Engine
from disagg_worker.engine.sampling import SamplingParams
from disagg_worker.instance.loop import Stepper
from disagg_worker.request import messages as msg


def make_engine(
    model: str,
    *,
    page_size=4,
    tokens=4096,
    cache=True,
    chunk=16,
    overlap=True,
    max_running=64,
    batch_tokens=2048,
    policy="fcfs",
) -> Engine:
    cfg = EngineConfig(
        model_path=model,
        cache=CacheConfig(page_size=page_size, max_total_tokens=tokens, enable_prefix_cache=cache),
        scheduler=SchedulerConfig(
            chunk_size=chunk,
            enable_overlap=overlap,
            max_running_requests=max_running,
            max_batch_tokens=batch_tokens,
            scheduling_policy=policy,
        ),
    )
    return load_engine(cfg)


def run_all(
    engine: Engine,
    requests: list[tuple[list[int], SamplingParams]],
    overlap: bool,
    abort_after: dict[str, int] | None = None,
    flush: bool = True,
) -> dict[str, list[msg.TokenOut]]:
    assert engine.cfg.overlap == overlap  # the executor's: launched steps overlap
    stepper = Stepper(engine)
    for i, (ids, params) in enumerate(requests):
        engine.handle(msg.GenerateReq(str(i), ids, params))
    outs: dict[str, list[msg.TokenOut]] = {}
    steps = forwards = 0
    deadline = time.monotonic() + 300  # a hang's guard; steps that only wait (for a grammar) are not counted
    while stepper.busy:
        forwards += stepper.computing
        stepper.step()
        steps += 1
        assert forwards < 10_000 and time.monotonic() < deadline, "the engine did not finish"
        for o in engine.take_outputs():
            outs.setdefault(o.rid, []).append(o)
        for rid, after in (abort_after or {}).items():
            if steps == after:
                engine.handle(msg.AbortReq(rid))
    stepper.close()
    for o in engine.take_outputs():
        outs.setdefault(o.rid, []).append(o)
    assert_idle_accounting(engine, flush)
    return outs


def assert_idle_accounting(engine: Engine, flush: bool = True) -> None:
    assert engine.radix.total_refs() == 0
    assert engine.allocator.num_free + engine.radix.total_pages == engine.allocator.num_total
    if flush:
        engine.handle(msg.FlushCacheReq())
        assert engine.allocator.num_free == engine.allocator.num_total


def tokens_of(outs: list[msg.TokenOut]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def varied_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(10, 2000) for _ in range(40)]
    prompts = []
    for i in range(n):
        length = rng.choice([3, 9, 17, 50, 90])
        own = [rng.randrange(10, 2000) for _ in range(length)]
        prompts.append(shared[: rng.choice([8, 21, 40])] + own if i % 3 == 0 else own)
    return prompts


GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """One request at a time, no batching, no prefix cache, no chunking, no overlap."""
    prompts = varied_prompts(16)
    engine = make_engine(tiny_model, cache=False, chunk=0, overlap=False, max_running=1)
    out = run_all(engine, [(p, GREEDY) for p in prompts], overlap=False)
    return prompts, [tokens_of(out[str(i)]) for i in range(len(prompts))]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("chunk", [0, 16])
def test_batched_equals_one_at_a_time(tiny_model, reference, overlap, chunk):
    prompts, expected = reference
    engine = make_engine(tiny_model, chunk=chunk, overlap=overlap)
    out = run_all(engine, [(p, GREEDY) for p in prompts], overlap=overlap)
    assert [tokens_of(out[str(i)]) for i in range(len(prompts))] == expected
    assert all(out[str(i)][-1].finish_reason == "length" for i in range(len(prompts)))


def test_overlap_runs_decode_steps_on_the_runner_thread_and_prompt_chunks_inline(tiny_model, reference):
    """With overlap on, only decode-only steps go to the runner thread; a batch with a prompt chunk
    runs on the loop's thread (the overlap would hide little and slow the chunk). Same tokens."""
    prompts, expected = reference
    engine = make_engine(tiny_model, chunk=16)
    seen: list[tuple[bool, bool]] = []  # (has a prompt chunk, ran on the loop's thread)
    run = engine.runner.run

    def spy(batch):
        seen.append((not batch.forward.is_decode, threading.current_thread() is threading.main_thread()))
        return run(batch)

    engine.runner.run = spy
    out = run_all(engine, [(p, GREEDY) for p in prompts[:4]], overlap=True)
    assert [tokens_of(out[str(i)]) for i in range(4)] == expected[:4]
    assert {inline for chunk, inline in seen if chunk} == {True}
    assert {inline for chunk, inline in seen if not chunk} == {False}


def test_prefix_cache_is_reused(tiny_model):
    engine = make_engine(tiny_model)
    prefix = list(range(100, 164))
    first = run_all(engine, [(prefix + [7, 8], GREEDY)], overlap=True, flush=False)
    second = run_all(engine, [(prefix + [9, 10], GREEDY)], overlap=True)
    assert first["0"][-1].cached_tokens == 0
    assert second["0"][-1].cached_tokens == 64


@pytest.mark.parametrize("tokens,overlap", [(256, True), (160, True), (160, False)])
def test_retraction_under_page_pressure_keeps_outputs(tiny_model, reference, tokens, overlap):
    prompts, expected = reference
    # 40-64 pages of 4 tokens cannot hold 16 requests of up to ~150 tokens at once.
    assert max(len(p) for p in prompts) + GREEDY.max_new_tokens <= tokens
    engine = make_engine(tiny_model, tokens=tokens, chunk=16, overlap=overlap)
    out = run_all(engine, [(p, GREEDY) for p in prompts], overlap=overlap)
    assert [tokens_of(out[str(i)]) for i in range(len(prompts))] == expected


def test_prompt_over_capacity_is_rejected_with_400(tiny_model):
    engine = make_engine(tiny_model, tokens=64)
    out = run_all(engine, [(list(range(10, 90)), GREEDY), ([5, 6, 7], GREEDY)], overlap=True)
    assert out["0"][-1].error_status == 400
    assert "does not fit the KV cache" in out["0"][-1].error
    assert len(tokens_of(out["1"])) == GREEDY.max_new_tokens


def test_request_alone_in_a_full_cache_finishes_with_length(tiny_model):
    engine = make_engine(tiny_model, tokens=32, page_size=4)
    params = SamplingParams(max_new_tokens=100, temperature=0.0, ignore_eos=True)
    out = run_all(engine, [(list(range(10, 20)), params)], overlap=True)
    assert out["0"][-1].finish_reason == "length"
    # 32 slots: 10 prompt tokens + 22 generated ones have KV; the 23rd token needs none.
    assert len(tokens_of(out["0"])) == 32 - 10 + 1


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_at_any_stage_frees_pages(tiny_model, overlap):
    engine = make_engine(tiny_model, tokens=512, chunk=8, max_running=4, overlap=overlap)
    prompts = varied_prompts(12, seed=3)
    params = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    aborts = {str(i): 1 + (i * 3) % 17 for i in range(0, 12, 2)}
    out = run_all(engine, [(p, params) for p in prompts], overlap=overlap, abort_after=aborts)
    for i in range(12):
        last = out[str(i)][-1]
        assert last.finish_reason in ("abort", "length")
        if str(i) not in aborts:
            assert last.finish_reason == "length"


def test_max_running_requests_is_respected(tiny_model):
    engine = make_engine(tiny_model, max_running=3)
    assert engine.cfg.overlap is True  # the executor's: launched steps overlap
    stepper = Stepper(engine)
    for i, p in enumerate(varied_prompts(8)):
        engine.handle(msg.GenerateReq(str(i), p, GREEDY))
    peak = 0
    while stepper.busy:
        stepper.step()
        peak = max(peak, len(engine.scheduler.running))
        engine.take_outputs()
    stepper.close()
    assert peak == 3
    assert_idle_accounting(engine)


def test_stop_token_and_eos(tiny_model):
    engine = make_engine(tiny_model)
    base = run_all(engine, [([11, 12, 13], GREEDY)], overlap=True)
    toks = tokens_of(base["0"])
    stop_at = toks[4]
    params = SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=(stop_at,))
    out = run_all(engine, [([11, 12, 13], params)], overlap=True)
    got = tokens_of(out["0"])
    assert got == toks[: toks.index(stop_at) + 1]
    assert out["0"][-1].finish_reason == "stop"


def test_seeded_sampling_is_reproducible_across_batches(tiny_model):
    engine = make_engine(tiny_model)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = run_all(engine, [([20, 21, 22], params)], overlap=True)
    crowd = run_all(engine, [([20, 21, 22], params)] + [(p, GREEDY) for p in varied_prompts(6)], overlap=True)
    assert tokens_of(alone["0"]) == tokens_of(crowd["0"])
