"""LoRA adapters through P/D, in one process over the `fake` transfer backend: the aux record names the adapter
the prompt ran under, decode decodes each adapter's requests as a monolithic engine does and refuses KV of another
adapter for that request alone; the router pairs a request for an adapter only with workers that serve it, lists
the adapters, and answers 404 naming `model` when no pair could serve one; /metrics' lora_requests_info."""

from __future__ import annotations

import itertools
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from disagg_worker.config import CacheConfig, DisaggConfig, EngineConfig, Role, SchedulerConfig
from disagg_worker.disagg import adapter_tag, pack_aux, unpack_adapter_tag, unpack_first_token, unpack_top_logprobs
from disagg_worker.engine.assemble import load_engine
from disagg_worker.engine.engine import Engine
from disagg_worker.instance.loop import Stepper
from disagg_worker.lora_config import LoraConfig
from disagg_worker.request import messages as msg
from disagg_worker.request.errors import APIError
from disagg_worker.request.params import SamplingParams
from disagg_worker.router.payload import SharedBody
from disagg_worker.router.worker import Worker
from disagg_worker.router.workers import WorkerPool
from disagg_worker.server.metrics import ServerMetrics
from disagg_worker.tuning import TUNING
from tests.lora_adapters import ATTENTION, MLP, write_adapter

ROOMS = itertools.count(3 << 40)  # the fake backend pairs rooms process-wide: none another module uses
PROMPTS = [[5, 17, 300, 42, 9, 1500, 77, 8, 640, 12, 33], [900, 4, 250, 61, 1000, 23]]
MODELS = ("", "attn", "mlp")  # the base model, then the adapters
N = 5


def test_the_aux_record_names_the_adapter_the_prompt_ran_under():
    top = [(3, -0.5), (9, -1.25)]
    for adapter in MODELS:
        aux = pack_aux(42, -0.5, top, adapter=adapter)
        assert (unpack_first_token(aux), unpack_top_logprobs(aux)) == ((42, -0.5), top)
        assert unpack_adapter_tag(aux) == adapter_tag(adapter)
    assert adapter_tag("") == 0 and len({adapter_tag(a) for a in MODELS}) == 3
    assert adapter_tag("attn") == adapter_tag("attn")  # the same name on every instance


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "attn": write_adapter(tiny_model, root / "attn", ATTENTION, r=8, alpha=16, seed=1),
        "mlp": write_adapter(tiny_model, root / "mlp", MLP, r=4, alpha=8, seed=2),
    }


def config(model: str, role: Role, adapters: dict, max_loras: int) -> EngineConfig:
    return EngineConfig(
        model_path=model,
        cache=CacheConfig(page_size=4, max_total_tokens=512),
        scheduler=SchedulerConfig(chunk_size=8, max_running_requests=8),
        disagg=DisaggConfig(role=role, transfer_backend="fake"),
        lora=LoraConfig(modules=tuple(f"{n}={p}" for n, p in adapters.items()), max_loras=max_loras, max_lora_rank=8),
    )


@pytest.fixture(scope="module")
def engines(tiny_model, adapters):
    # Decode holds one slot for two adapters: a request whose adapter is not resident waits for the slot.
    made = [
        load_engine(config(tiny_model, role, adapters, max_loras))
        for role, max_loras in ((Role.MONOLITHIC, 2), (Role.PREFILL, 2), (Role.DECODE, 1))
    ]
    yield made
    for e in made:
        e.close()


def drive(asks: list[tuple[Engine, msg.GenerateReq]]) -> dict[str, msg.TokenOut]:
    """Hand each engine its requests, step them all until idle; each request's tokens and end, merged."""
    for engine, req in asks:
        engine.handle(req)
    engines = list({id(e): e for e, _ in asks}.values())
    steppers = [Stepper(e) for e in engines]
    outs: dict[str, msg.TokenOut] = {}
    for _ in range(5000):
        if not any(s.busy for s in steppers):
            break
        for s in steppers:
            s.step()
        for o in [o for e in engines for o in e.take_outputs()]:
            prev = outs.get(o.rid)
            outs[o.rid] = o if prev is None else msg.TokenOut(o.rid, prev.token_ids + o.token_ids, **_end(o))
    for s in steppers:
        s.close()
    for e in engines:
        e.handle(msg.FlushCacheReq())
        assert e.allocator.num_free == e.allocator.num_total  # every page back, whatever failed
        assert not any(e.scheduler.adapters.users.values())  # and every adapter slot
    return outs


def _end(o: msg.TokenOut) -> dict:
    return {"finish_reason": o.finish_reason, "error": o.error, "error_status": o.error_status}


def params(adapter: str) -> SamplingParams:
    return SamplingParams(max_new_tokens=N, temperature=0.0, ignore_eos=True, lora=adapter)


def pd(p: Engine, d: Engine, rid: str, ids: list[int], prefill_adapter: str, decode_adapter: str) -> list:
    info = msg.BootstrapInfo("127.0.0.1", 1, next(ROOMS))
    return [
        (p, msg.GenerateReq(f"p-{rid}", ids, params(prefill_adapter), info)),
        (d, msg.GenerateReq(f"d-{rid}", ids, params(decode_adapter), info)),
    ]


def test_prefill_computes_each_prompt_under_its_adapter_and_decode_goes_on_mixed_and_waiting_for_a_slot(engines):
    """The fake backend moves no KV: the first token (prefill's, in the aux record) is the one to compare here; the
    integration tier compares whole answers over Mooncake."""
    mono, p, d = engines
    asks = [(m, i) for m in MODELS for i in range(len(PROMPTS))]
    want = drive([(mono, msg.GenerateReq(f"m-{m}{i}", PROMPTS[i], params(m))) for m, i in asks])
    got = drive([a for m, i in asks for a in pd(p, d, f"{m}{i}", PROMPTS[i], m, m)])
    for m, i in asks:
        first = want[f"m-{m}{i}"].token_ids[0]
        assert got[f"p-{m}{i}"].token_ids == [first], (m, i)
        decoded = got[f"d-{m}{i}"]
        assert (decoded.token_ids[0], len(decoded.token_ids), decoded.error) == (first, N, ""), (m, i)
    assert len({want[f"m-{m}{i}"].token_ids[0] for m in MODELS for i in (0, 1)}) > 2  # the adapters change them


def test_kv_computed_under_another_adapter_fails_that_decode_request_alone(engines):
    _, p, d = engines
    ids = PROMPTS[0]
    got = drive(
        pd(p, d, "wrong", ids, "attn", "mlp") + pd(p, d, "base", ids, "attn", "") + pd(p, d, "ok", ids, "mlp", "mlp")
    )
    for rid, mine in (("wrong", "LoRA adapter mlp"), ("base", "the base model")):
        out = got[f"d-{rid}"]
        assert (out.error_status, out.token_ids) == (500, [])
        assert f"prefill computed the prompt under another adapter than {mine}: refused" in out.error
    assert not got["d-ok"].error and len(got["d-ok"].token_ids) == N


def worker(url: str, role: str, adapters: list[str], resident: tuple[str, ...] = (), requests: int = 0) -> Worker:
    w = Worker(url, role, healthy=True)
    report = {"lora_adapters": adapters, "lora_resident": list(resident), "load": {"requests": requests}}
    w.take_report(json.dumps(report).encode())  # as its /health lists them
    return w


def test_an_adapters_request_goes_first_where_it_is_resident_unless_that_is_far_busier():
    slack = TUNING.router.lora_affinity_slack
    p = worker("http://p", "prefill", ["attn", "mlp"], ("attn", "mlp"))
    warm = worker("http://d1", "decode", ["attn", "mlp"], ("mlp",), requests=slack)
    cold = worker("http://d2", "decode", ["attn", "mlp"], ("attn",))
    pool = WorkerPool(static=[p, warm, cold])
    assert pool.cold("mlp", set()) == {cold}
    assert {pool.pick_pair(pool.cold("mlp", set())) for _ in range(4)} == {(p, warm)}
    assert pool.cold("attn", set()) == {warm} and pool.cold("", set()) == set()  # the base model: no affinity
    # Far busier: any instance that serves it (the adapter then loads there).
    busier = worker("http://d1", "decode", ["attn", "mlp"], ("mlp",), requests=slack + 1)
    assert WorkerPool(static=[p, busier, cold]).cold("mlp", set()) == set()
    # Out of rotation, or left out by the caller: the rest go by the policy alone.
    warm.healthy = False
    assert pool.cold("mlp", set()) == set()
    warm.healthy = True
    assert pool.cold("mlp", {warm}) == set()


def test_the_pool_pairs_an_adapters_request_only_with_workers_that_serve_it():
    p1, p2 = worker("http://p1", "prefill", ["attn"]), worker("http://p2", "prefill", ["attn", "mlp"])
    d1, d2 = worker("http://d1", "decode", ["attn", "mlp"]), worker("http://d2", "decode", [])
    pool = WorkerPool(static=[p1, p2, d1, d2])
    assert pool.adapters() == ["attn", "mlp"]
    for _ in range(4):
        assert pool.pick_pair(pool.lacking("mlp")) == (p2, d1)
    assert {pool.pick_pair(pool.lacking("attn")) for _ in range(4)} == {(p1, d1), (p2, d1)}
    assert pool.lacking("") == pool.lacking("tiny") == set()  # the base, or a name the workers answer for
    # An adapter no decode serves: no pair could, whatever their health; /v1/models does not list it.
    pool = WorkerPool(static=[p1, p2, d2])
    assert pool.adapters() == []
    with pytest.raises(APIError) as e:
        pool.lacking("attn")
    assert (e.value.status, e.value.param, e.value.code) == (404, "model", "model_not_found")
    assert "`attn`" in e.value.message


def test_the_router_reads_the_model_a_body_names():
    assert SharedBody.of({"model": "attn", "prompt": [1], "n": 2}).model == "attn"
    assert SharedBody.of({"prompt": [1]}).model == SharedBody.of({"model": 7}).model == ""


def samples(m: ServerMetrics) -> dict[str, list[tuple[dict, float]]]:
    out: dict[str, list[tuple[dict, float]]] = {}
    for f in text_string_to_metric_families(m.render().decode()):
        for s in f.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_lora_requests_info_names_the_running_and_waiting_adapters_as_vllm_does():
    m = ServerMetrics("decode-0", "decode", max_loras=2)
    m.observe_stats(msg.SchedulerStats(100.0, 2, 1, 0, 400, 0, 0, 7, lora_running=("attn",)))
    m.observe_stats(msg.SchedulerStats(101.0, 2, 1, 0, 400, 0, 0, 8, lora_running=("attn", "mlp"), lora_waiting=("x",)))
    want = {"running_lora_adapters": "attn,mlp", "waiting_lora_adapters": "x", "max_lora": "2"}
    got = samples(m)
    for name in ("disagg_lora_requests_info", "vllm:lora_requests_info"):
        assert got[name] == [({"instance": "decode-0", **want}, 101.0)]  # the latest report's labels, at its time
    assert "vllm:lora_requests_info" not in samples(ServerMetrics("decode-0", "decode"))  # no adapters, no gauge
