"""The static decode step (`engine.cuda_graphs`), run eagerly on the CPU: what a CUDA graph replays.

Each decode step of a real engine run is computed twice, dynamically (as the CPU serves) and from the static
buffers of its bucket, padded; the logits must agree, and the padded rows must have written only the padding
page. A whole run with the static step in place must give the same tokens as without it. Every architecture runs,
MoE's host-free dense path and MLA's attention over the bucket's page table included.
"""

from __future__ import annotations

import pytest
import torch

from disagg_worker.config import DisaggConfig, EngineConfig, Role, SchedulerConfig
from disagg_worker.engine.cuda_graphs import DecodeGraphs, buckets, wanted
from disagg_worker.engine.engine import Engine
from disagg_worker.engine.sampling import SamplingParams
from disagg_worker.instance.loop import Stepper
from disagg_worker.model.batch import ForwardBatch
from disagg_worker.request import messages as msg
from tests.unit.model_stubs import ARCHS
from tests.unit.test_engine import assert_idle_accounting, make_engine, run_all, tokens_of, varied_prompts

pytest_plugins = ["tests.unit.conftest_model"]

MAX_BS = 4  # small, so that the varied batches below fall in every bucket, padded, and beyond (eager)
MAX_CONTEXT = 256  # the requests below stay within it (a step of a longer one runs eagerly); the gather spans it


def test_buckets_cover_every_batch_size_up_to_the_largest():
    assert buckets(1) == (1,)
    assert buckets(4) == (1, 2, 4)
    assert buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert buckets(20) == (1, 2, 4, 8, 16, 20)


def test_only_a_single_rank_cuda_instance_without_a_draft_captures(tiny_model):
    engine = make_engine(tiny_model)
    model = engine.runner.model
    cuda = EngineConfig(model_path=tiny_model, device="cuda")
    assert wanted(cuda, model, single_rank=True, drafting=False)
    assert not wanted(EngineConfig(model_path=tiny_model), model, single_rank=True, drafting=False)  # a CPU
    off = EngineConfig(model_path=tiny_model, device="cuda", scheduler=SchedulerConfig(cuda_graph=False))
    assert not wanted(off, model, single_rank=True, drafting=False)
    assert not wanted(cuda, model, single_rank=False, drafting=False)
    assert not wanted(cuda, model, single_rank=True, drafting=True)
    assert not wanted(cuda, None, single_rank=True, drafting=False)  # --forward noop
    prefill = EngineConfig(model_path=tiny_model, device="cuda", disagg=DisaggConfig(role=Role.PREFILL))
    assert not wanted(prefill, model, single_rank=True, drafting=False)
    assert engine.runner.graphs is None  # a CPU engine serves as before


def requests(n: int) -> list[tuple[list[int], SamplingParams]]:
    # Lengths differ, so requests finish at different steps: decode batches of every size from n down to 1.
    return [
        (p, SamplingParams(max_new_tokens=6 + 3 * i, temperature=0.0, ignore_eos=True))
        for i, p in enumerate(varied_prompts(n))
    ]


def drive(engine: Engine, graphs: DecodeGraphs, overlap: bool) -> dict[str, list[int]]:
    """Every request to its end; then the padding page back to the allocator and the pages accounted for."""
    assert engine.cfg.overlap == overlap  # the executor's: launched steps overlap
    stepper = Stepper(engine)
    for i, (ids, params) in enumerate(requests(8)):
        engine.handle(msg.GenerateReq(str(i), ids, params))
    tokens: dict[str, list[int]] = {}
    while stepper.busy:
        stepper.step()
        for o in engine.take_outputs():
            tokens.setdefault(o.rid, []).extend(o.token_ids)
    stepper.close()
    for o in engine.take_outputs():
        tokens.setdefault(o.rid, []).extend(o.token_ids)
    engine.allocator.free([graphs.pad_page])
    assert_idle_accounting(engine)
    return tokens


def with_static_step(engine: Engine) -> tuple[DecodeGraphs, list[int]]:
    """The engine's runner with a static step beside it (the padding page taken from its allocator), checking
    every decode step that fits against the dynamic one; returns the steps' batch sizes as they come."""
    (pad_page,) = engine.allocator.alloc(1) or []
    graphs = DecodeGraphs(engine.runner.model, engine.kv_pool, pad_page, MAX_BS, MAX_CONTEXT)
    runner, sizes = engine.runner, []
    dynamic = runner.forward

    def both(fwd: ForwardBatch, hidden: torch.Tensor | None = None) -> torch.Tensor:
        out = dynamic(fwd, hidden)
        if graphs.fits(fwd):
            before = [b.clone() for b in engine.kv_pool.buffers()]
            static = graphs.run(fwd)
            torch.testing.assert_close(static, out, rtol=1e-5, atol=1e-5)
            assert torch.equal(static.argmax(-1), out.argmax(-1))
            assert_written_only(engine, before, fwd.out_slots, pad_page)
            sizes.append(fwd.num_requests)
        return out

    runner.forward = both  # type: ignore[method-assign]
    return graphs, sizes


def assert_written_only(engine: Engine, before: list[torch.Tensor], out_slots: torch.Tensor, pad_page: int) -> None:
    """The static step changed no slot but the batch's own new tokens' and the padding page's."""
    page_size = engine.kv_pool.page_size
    allowed = torch.zeros(engine.kv_pool.num_pages * page_size, dtype=torch.bool)
    allowed[out_slots] = True
    allowed[pad_page * page_size : (pad_page + 1) * page_size] = True
    for old, new in zip(before, engine.kv_pool.buffers(), strict=True):
        changed = (old.view(allowed.shape[0], -1) != new.view(allowed.shape[0], -1)).any(-1)
        assert not (changed & ~allowed).any(), "the static step wrote a slot of no request of its batch"


@pytest.mark.parametrize("arch", ARCHS)
def test_the_static_decode_step_equals_the_dynamic_one(tiny_dirs, one_torch_thread, arch):
    engine = make_engine(str(tiny_dirs[arch]), overlap=False, chunk=512)  # prompts in one step: then decode only
    graphs, sizes = with_static_step(engine)
    pad = lambda: [b[graphs.pad_page].clone() for b in engine.kv_pool.buffers()]  # noqa: E731
    untouched = pad()
    drive(engine, graphs, overlap=False)
    # Every bucket ran, a padded one (3 of 4) too; the batches of 5 to 8 ran eagerly.
    assert {1, 2, 3, 4} <= set(sizes), sizes
    assert any(not torch.equal(a, b) for a, b in zip(untouched, pad(), strict=True)), "no padding row was written"


def test_generation_with_the_static_step_equals_generation_without(tiny_model):
    ref = run_all(make_engine(tiny_model), requests(8), overlap=True)
    engine = make_engine(tiny_model)
    (pad_page,) = engine.allocator.alloc(1) or []
    graphs = DecodeGraphs(engine.runner.model, engine.kv_pool, pad_page, MAX_BS, MAX_CONTEXT)
    engine.runner.graphs = graphs
    assert drive(engine, graphs, overlap=True) == {r: tokens_of(o) for r, o in ref.items()}
