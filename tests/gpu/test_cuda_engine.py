"""The engine on CUDA gives what it gives on the CPU: fp32 greedy tokens of every tiny architecture equal the
CPU's and transformers', batching does not change them (overlap on, CUDA graphs on), a structured-output request
is answered under its grammar, and every page is accounted for afterwards. On CUDA attention runs as the Triton
kernels (`model/triton_attention.py`), which equal the torch path there in float32 and bfloat16; decode steps
replay CUDA graphs (`engine/cuda_graphs.py`) and give the tokens of eager steps."""

from __future__ import annotations

import json

import pytest
import torch

from disagg_worker.config import CacheConfig, EngineConfig, SchedulerConfig
from disagg_worker.engine.assemble import load_engine
from disagg_worker.engine.engine import Engine
from disagg_worker.engine.sampling import SamplingParams
from disagg_worker.model.attention import AttentionPlan, paged_attention
from disagg_worker.model.triton_attention import triton_paged_attention
from tests.unit.test_engine import run_all, tokens_of
from tests.unit.triton_interpreted import HEAD_DIM, KV_HEADS, batch_of, pool

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(20 + 13 * i, 20 + 13 * i + 5 + 9 * i)) for i in range(8)]


def engine(model: str, device: str, max_running: int = 64, cuda_graph: bool = True, dtype: str = "float32") -> Engine:
    """On CUDA its decode steps replay CUDA graphs unless `cuda_graph` is False (`engine.cuda_graphs`)."""
    cfg = EngineConfig(
        model_path=model,
        device=device,
        dtype=dtype,
        cache=CacheConfig(page_size=16, max_total_tokens=16384, kv_dtype=dtype),
        scheduler=SchedulerConfig(
            chunk_size=64, enable_overlap=True, max_running_requests=max_running, cuda_graph=cuda_graph
        ),
    )
    return load_engine(cfg)


def replays(e: Engine) -> int:
    assert e.runner.graphs is not None, "no CUDA graphs on a CUDA engine"
    return e.runner.graphs.replays


def run(e: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    """Each request's tokens (run_all: overlap on, every page accounted for afterwards); none may fail."""
    outs = run_all(e, requests, overlap=True)
    for rid, got in outs.items():
        assert not got[-1].error, (rid, got[-1].error)
    return [tokens_of(outs[str(i)]) for i in range(len(requests))]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_fp32_greedy_tokens_on_cuda_equal_the_cpu_and_transformers(tiny_models, arch):
    import transformers

    model = tiny_models[arch]
    cuda = run(engine(model, "cuda"), [(p, GREEDY) for p in PROMPTS])
    cpu = run(engine(model, "cpu"), [(p, GREEDY) for p in PROMPTS])
    assert cuda == cpu
    ref = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to("cuda").eval()
    for prompt, got in zip(PROMPTS[:3], cuda, strict=False):
        ids = torch.tensor([prompt], device="cuda")
        out = ref.generate(ids, max_new_tokens=GREEDY.max_new_tokens, do_sample=False, min_new_tokens=12)
        assert out[0, len(prompt) :].tolist() == got


def test_batched_equals_one_at_a_time_on_cuda(tiny_models):
    model = tiny_models["llama"]
    prompts = [list(range(30 + 7 * i, 30 + 7 * i + 3 + (i * 37) % 120)) for i in range(32)]
    many, one = engine(model, "cuda"), engine(model, "cuda", max_running=1)
    batched = run(many, [(p, GREEDY) for p in prompts])
    alone = run(one, [(p, GREEDY) for p in prompts])
    assert batched == alone
    assert replays(many) and replays(one), "the decode steps ran eagerly: CUDA graphs were on"


def test_a_structured_output_request_is_answered_on_cuda_as_on_the_cpu(tiny_models):
    model = tiny_models["llama"]
    params = SamplingParams(max_new_tokens=48, temperature=0.0, grammar=json.dumps({"type": "json_object"}))
    cuda = run(engine(model, "cuda"), [(PROMPTS[0], params)])
    cpu = run(engine(model, "cpu"), [(PROMPTS[0], params)])
    assert cuda == cpu and cuda[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "plan",
    [[(149, 1), (36, 1), (200, 1)], [(40, 23), (0, 70), (57, 1)], [(0, 300), (0, 57)]],
    ids=["decode", "extend", "fresh"],
)
def test_triton_attention_equals_the_torch_path_on_cuda(plan, dtype):
    """float32 within 1e-4 (the kernels' products are IEEE, not tf32); bfloat16 within atol 3e-2 (a few of its
    ulps at outputs of order 1; both sides round K/V and the probabilities to bfloat16 differently)."""
    k_buf, v_buf = (b.to("cuda", dtype) for b in pool(16, seed=7))
    batch = batch_of(plan, 16, seed=7).to("cuda")
    q = torch.randn(batch.num_tokens, KV_HEADS * 4, HEAD_DIM, device="cuda", dtype=dtype)
    torch_plan = AttentionPlan.build(batch, q.device)
    triton_plan = AttentionPlan.build(batch, q.device, page_size=16)
    assert torch_plan.pages is None and triton_plan.pages is not None
    got = paged_attention(q, triton_plan, k_buf, v_buf)  # fresh prompts: SDPA's flash kernel, else the kernels
    kernels = triton_paged_attention(q, triton_plan.pages, k_buf, v_buf)
    expected = paged_attention(q, torch_plan, k_buf, v_buf)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=0)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), **tol)
    torch.testing.assert_close(kernels.float(), expected.float(), **tol)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "deepseek_v3"])
def test_replayed_decode_steps_give_the_tokens_of_eager_ones(tiny_models, arch):
    """Dense attention through the kernels' page tables, MoE on its dense path, MLA gathering by the table."""
    from disagg_worker.engine.cuda_graphs import buckets

    requests = [(p, GREEDY) for p in PROMPTS]
    captured = engine(tiny_models[arch], "cuda")
    assert captured.runner.graphs is not None and set(captured.runner.graphs.graphs) == set(buckets(64))
    got = run(captured, requests)
    assert replays(captured)
    eager = engine(tiny_models[arch], "cuda", cuda_graph=False)
    assert eager.runner.graphs is None
    assert got == run(eager, requests)


def test_a_fragmented_destinations_staging_gathers_and_scatters_device_pages():
    """What a transfer into a fragmented destination does to device memory (`disagg/mooncake/staging.py`): prefill
    gathers the room's pages into its staging area, decode scatters the landed block to its pages, both by tensor
    operations on the pool's device (the CPU cannot address a GPU's memory through raw pointers). A P/D stack
    stages only when decode's free pages are split in many short runs, which the P/D tests here do not force."""
    from disagg_worker.disagg.mooncake.staging import StagingArea, gather, scatter

    page, pages = 4096, [7, 2, 30, 31, 11]
    prefill = torch.randint(0, 256, (64 * page,), dtype=torch.uint8, device="cuda")
    decode = torch.zeros(64 * page, dtype=torch.uint8, device="cuda")
    area = StagingArea(len(pages) * page, device="cuda")
    block = area.view(area.alloc(len(pages) * page), len(pages) * page)
    gather(prefill, page, pages, block)
    targets = [40, 3, 17, 18, 60]  # decode's pages, in the room's order
    scatter(block, page, decode, targets)
    rows_p, rows_d = prefill.view(64, page), decode.view(64, page)
    for src, dst in zip(pages, targets, strict=True):
        assert torch.equal(rows_d[dst], rows_p[src])
    assert int(decode.count_nonzero()) == int(sum(rows_p[p].count_nonzero() for p in pages))
