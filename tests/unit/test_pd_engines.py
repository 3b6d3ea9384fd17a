"""Prefill and decode queues over the `fake` transfer backend, in one process: life cycles, page
accounting and error paths (real KV movement is covered by the integration tier)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from disagg_worker.config import CacheConfig, DisaggConfig, EngineConfig, Role, SchedulerConfig
from disagg_worker.engine.assemble import load_engine
from disagg_worker.engine.engine import Engine
from disagg_worker.instance.loop import Stepper
from disagg_worker.request import messages as msg
from disagg_worker.request.params import SamplingParams

ROOMS = itertools.count(1000)


def config(model: str, role: Role, tokens: int = 2048, max_running: int = 16) -> EngineConfig:
    return EngineConfig(
        model_path=model,
        cache=CacheConfig(page_size=4, max_total_tokens=tokens),
        scheduler=SchedulerConfig(chunk_size=8, max_running_requests=max_running),
        disagg=DisaggConfig(role=role, transfer_backend="fake"),
    )


@pytest.fixture(scope="module")
def engines(tiny_model):
    p = load_engine(config(tiny_model, Role.PREFILL))
    d = load_engine(config(tiny_model, Role.DECODE, tokens=256, max_running=4))
    yield p, d
    p.close()
    d.close()


STAGE_QUEUES = ("bootstrapping", "prefilling", "inflight", "prealloc", "transfer")


def where(engine: Engine, rid: str) -> str:
    """The queue of `engine` that holds `rid` ("" if none does): a stage queue, else the running batch."""
    queues = {name: set(getattr(engine.stage, name, {})) for name in STAGE_QUEUES}
    queues["running"] = {r.rid for r in engine.scheduler.running}
    return next((name for name, rids in queues.items() if rid in rids), "")


def run(
    engines,
    requests: list[tuple[list[int], int]],
    abort: dict[str, str] | None = None,
    watch=None,
):
    """Send each (prompt, max_tokens) to both engines with a fresh room; step both until idle.

    `abort` maps a request id to the queue it is aborted in (on its own side), as soon as it is
    seen there; every such abort must happen. `watch(p, d)` is called after every step."""
    p, d = engines
    assert p.cfg.overlap is True  # the executor's: launched steps overlap
    assert d.cfg.overlap is True  # the executor's: launched steps overlap
    sp, sd = Stepper(p), Stepper(d)
    pending = dict(abort or {})
    for i, (ids, n) in enumerate(requests):
        params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        info = msg.BootstrapInfo("127.0.0.1", 1, next(ROOMS))
        p.handle(msg.GenerateReq(f"p{i}", ids, params, info))
        d.handle(msg.GenerateReq(f"d{i}", ids, params, info))
    outs: dict[str, list[msg.TokenOut]] = {}
    for _ in range(5000):
        for rid, queue in list(pending.items()):
            engine = p if rid.startswith("p") else d
            if where(engine, rid) == queue:
                engine.handle(msg.AbortReq(rid))
                del pending[rid]
        if not (sp.busy or sd.busy):
            break
        sp.step()
        sd.step()
        if watch is not None:
            watch(p, d)
        for o in p.take_outputs() + d.take_outputs():
            outs.setdefault(o.rid, []).append(o)
    sp.close()
    sd.close()
    assert not pending, f"requests never seen in the queue to abort them in: {pending}"
    for o in p.take_outputs() + d.take_outputs():
        outs.setdefault(o.rid, []).append(o)
    for e in (p, d):
        assert not any(e.queue_sizes().values()), e.queue_sizes()
        e.handle(msg.FlushCacheReq())
        assert e.allocator.num_free == e.allocator.num_total
        assert e.radix.total_refs() == 0
    return outs


def tokens(outs: list[msg.TokenOut]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def test_life_cycle_first_token_travels_with_the_kv(engines):
    prompts = [(list(range(10, 10 + n)), 6) for n in (3, 9, 30)]
    outs = run(engines, prompts)
    for i in range(len(prompts)):
        prefill, decode = tokens(outs[f"p{i}"]), tokens(outs[f"d{i}"])
        assert len(prefill) == 1, "prefill samples exactly the first token"
        assert decode[0] == prefill[0]
        assert len(decode) == 6
        assert outs[f"d{i}"][-1].finish_reason == "length"


def test_decode_preallocates_only_what_fits(engines):
    # 64 pages of 4 tokens on decode: 8 requests of 100 tokens cannot all be preallocated at once.
    prompts = [(list(range(20 + i, 120 + i)), 4) for i in range(8)]
    seen = {"held": 0, "peak": 0}

    def watch(p, d):  # after a step: its tick preallocated whatever fitted
        q = d.queue_sizes()
        seen["held"] = max(seen["held"], q["decode_prealloc"])
        seen["peak"] = max(seen["peak"], q["decode_transfer"] + d.scheduler.num_running)

    outs = run(engines, prompts, watch=watch)
    assert all(len(tokens(outs[f"d{i}"])) == 4 for i in range(8))
    # 25 pages per prompt plus one reserved per running request: two at a time, the rest held back.
    assert seen["peak"] == 2, seen
    assert seen["held"] == 6, seen  # the fake handshake is instant: all but two wait for pages


def test_requests_without_a_room_are_refused(engines):
    p, d = engines
    for e, name in ((p, "prefill"), (d, "decode")):
        e.handle(msg.GenerateReq("x", [1, 2, 3], SamplingParams()))
        out = e.take_outputs()
        assert out[-1].error_status == 400 and name in out[-1].error


def test_prompt_over_capacity_is_refused_on_both_sides(engines):
    outs = run(engines, [(list(range(10, 10 + 3000)), 2)])
    assert outs["p0"][-1].error_status == 400
    assert outs["d0"][-1].error_status == 400


def test_aborts_on_either_side_free_everything(engines, caplog):
    prompts = [(list(range(30, 30 + 20 + i)), 8) for i in range(6)]
    # Each abort hits its side while the other side still waits on it, except d4: it is aborted
    # while decoding, after prefill handed its KV over and finished.
    abort = {
        "p0": "bootstrapping",
        "d1": "prealloc",
        "p2": "prefilling",
        "d3": "transfer",
        "d4": "running",
    }
    outs = run(engines, prompts, abort)
    for rid in ("p0", "d1", "p2", "d3"):
        peer = ("d" if rid[0] == "p" else "p") + rid[1:]
        assert outs[peer][-1].finish_reason == "error", (rid, outs[peer][-1])
        # The client reads what failed and where the details are; the cause (rooms, peers) stays in the log.
        assert f"request id {peer}" in outs[peer][-1].error
        assert any(f"request {peer}:" in r.message and "abort" in r.message for r in caplog.records), peer
    assert outs["p4"][-1].finish_reason == "length"
    assert outs["d4"][-1].finish_reason == "abort" and len(tokens(outs["d4"])) < 8
    assert len(tokens(outs["d5"])) == 8


@pytest.mark.parametrize("role,queue", [(Role.PREFILL, "prefill_bootstrap"), (Role.DECODE, "decode_prealloc")])
def test_waiting_queues_are_bounded(tiny_model, role, queue):
    """Requests waiting for a handshake beyond --max-bootstrap-queue / --max-prealloc-queue get a 503 at once."""
    bounded = DisaggConfig(role=role, transfer_backend="fake", max_bootstrap_queue=2, max_prealloc_queue=2)
    engine = load_engine(replace(config(tiny_model, role), disagg=bounded))
    try:
        params = SamplingParams(max_new_tokens=2)
        for i in range(3):  # no tick runs, so nothing leaves the queue
            engine.handle(msg.GenerateReq(f"r{i}", [5, 6, 7], params, msg.BootstrapInfo("127.0.0.1", 1, next(ROOMS))))
        refused = engine.take_outputs()
        assert [(o.rid, o.error_status) for o in refused] == [("r2", 503)]
        assert "queue is full" in refused[0].error
        assert engine.queue_sizes()[queue] == 2
        for i in range(2):
            engine.handle(msg.AbortReq(f"r{i}"))
        assert engine.queue_sizes()[queue] == 0
    finally:
        engine.close()
