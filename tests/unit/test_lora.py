"""LoRA adapters applied per row (`model/lora.py`) give PEFT's logits, rows of several adapters and of the base
model in one forward; an adapter that does not fit is refused naming it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from disagg_worker.cli import build_parser
from disagg_worker.cli_args import server_args_from_cli
from disagg_worker.config import Role
from disagg_worker.engine.lora_registry import Resident
from disagg_worker.engine.request import Req, lora_ids
from disagg_worker.engine.sampling import SamplingParams
from disagg_worker.env import load_env
from disagg_worker.errors import ConfigError
from disagg_worker.lora_config import LoraConfig
from disagg_worker.model.cpu_linear import PackedLinear, can_pack
from disagg_worker.model.loader import load_model
from disagg_worker.model.lora import LoraLayers, read_adapters
from disagg_worker.model.lora_files import LoraError
from disagg_worker.model.merged import merge_projections
from disagg_worker.model.tiny import make_tiny
from tests.lora_adapters import ATTENTION, MLP, peft_model, write_adapter
from tests.unit.model_stubs import PageAllocator, make_batch, model_pool

pytest_plugins = ["tests.unit.conftest_model"]
pytestmark = pytest.mark.usefixtures("one_torch_thread")

PAGE_SIZE = 4
ATOL = 1e-4
PROMPTS = [[5, 17, 300, 42, 9, 1500, 77, 8, 640, 12, 33], [900, 4, 250, 61], [7, 1024, 88, 19, 2000, 3, 45]]


@pytest.fixture(scope="module")
def setup(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = tiny_dirs["llama"]
    paths = {
        "attn": write_adapter(base, root / "attn", ATTENTION, r=8, alpha=16, seed=1),
        "mlp": write_adapter(base, root / "mlp", MLP, r=4, alpha=8, seed=2, use_rslora=True),
    }
    return base, paths, peft_model(base, paths)


def ours(base, paths, merged: bool = False):
    model, cfg = load_model(base, "float32", "cpu")
    if merged:  # the GPU path's merged q/k/v and gate/up, here on the CPU
        assert merge_projections(model) > 0
    model.lora = LoraLayers.attach(model, read_adapters(list(paths.items())), max_rank=16)
    return model, cfg


def peft_logits(ref, ids: list[int], adapter: str | None) -> torch.Tensor:
    with torch.no_grad():
        if adapter is None:
            with ref.disable_adapter():
                return ref(torch.tensor([ids])).logits[0, -1]
        ref.set_adapter(adapter)
        return ref(torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("merged", [False, True])
def test_one_forward_mixing_two_adapters_and_the_base_gives_pefts_logits_row_by_row(setup, merged):
    base, paths, ref = setup
    model, cfg = ours(base, paths, merged)
    kv, alloc = model_pool(cfg, num_pages=64, page_size=PAGE_SIZE), PageAllocator(64, 0)
    rows = [(PROMPTS[0], "attn"), (PROMPTS[1], None), (PROMPTS[2], "mlp"), (PROMPTS[0], None), (PROMPTS[1], "mlp")]
    seqs = [alloc.new_seq(32, PAGE_SIZE) for _ in rows]
    slots = [{None: 0, "attn": 1, "mlp": 2}[a] for _, a in rows]
    batch = replace(make_batch(seqs, [p for p, _ in rows], PAGE_SIZE), lora_slots=slots)
    logits = model(batch, kv)
    for i, (prompt, adapter) in enumerate(rows):
        torch.testing.assert_close(logits[i], peft_logits(ref, prompt, adapter), atol=ATOL, rtol=0)
    # A decode step after it: one new token per row, each under its own adapter again.
    step = replace(make_batch(seqs, [[11]] * len(rows), PAGE_SIZE), lora_slots=slots)
    logits = model(step, kv)
    for i, (prompt, adapter) in enumerate(rows):
        torch.testing.assert_close(logits[i], peft_logits(ref, [*prompt, 11], adapter), atol=ATOL, rtol=0)
    assert not torch.allclose(logits[0], peft_logits(ref, [*PROMPTS[0], 11], None), atol=1e-2)  # it changed things


def test_an_adapter_above_the_maximum_rank_is_refused_naming_it(setup):
    base, paths, _ = setup
    model, _ = load_model(base, "float32", "cpu")
    with pytest.raises(LoraError, match="LoRA adapter attn: rank 8 exceeds --max-lora-rank 4"):
        LoraLayers.attach(model, read_adapters([("attn", str(paths["attn"]))]), max_rank=4)


def test_an_adapter_of_another_model_is_refused_naming_it_and_the_module(setup, tmp_path):
    base, paths, _ = setup
    other = make_tiny(tmp_path / "wide", seed=0, arch="qwen3")  # another head_dim: k_proj is wider
    model, _ = load_model(other, "float32", "cpu")
    with pytest.raises(
        LoraError,
        match=r"LoRA adapter attn: model.layers.0.self_attn.k_proj is \[128, 128\] in the model, the adapter.s "
        r"delta \[64, 128\]",
    ):
        LoraLayers.attach(model, read_adapters([("attn", str(paths["attn"]))]), max_rank=16)


def test_an_adapter_targeting_a_module_the_model_lacks_is_refused(setup, tmp_path):
    base, paths, _ = setup
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((paths["attn"] / "adapter_config.json").read_text())
    tensors = load_file(str(paths["attn"] / "adapter_model.safetensors"))
    save_file({k.replace("q_proj", "w_pack"): v for k, v in tensors.items()}, str(bad / "adapter_model.safetensors"))
    model, _ = load_model(base, "float32", "cpu")
    with pytest.raises(LoraError, match="LoRA adapter bad: it targets model.layers.0.self_attn.w_pack, which is not"):
        LoraLayers.attach(model, read_adapters([("bad", str(bad))]), max_rank=16)


def test_what_is_not_applied_is_refused_with_the_file(setup, tmp_path):
    _, paths, _ = setup
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((paths["attn"] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(LoraError, match=r"LoRA adapter dora: .*adapter_config.json: DoRA: not supported"):
        read_adapters([("dora", str(dora))])
    with pytest.raises(LoraError, match="LoRA adapter gone: cannot read"):
        read_adapters([("gone", str(tmp_path / "nowhere"))])


def test_the_prefix_cache_knows_an_adapters_tokens_apart():
    ids = [5, 17, 300, 2047]
    a, b = lora_ids(ids, "a"), lora_ids(ids, "b")
    assert len({tuple(ids), tuple(a), tuple(b)}) == 3 and min(a + b) > 1 << 32
    assert lora_ids(ids, "a") == a and max(a + b) < 1 << 63  # the same on every instance; a page name's int64


@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16), reason="no oneDNN bfloat16 on this CPU")
def test_bfloat16_projections_packed_for_onednn_get_their_deltas_too(setup):
    base, paths, ref = setup
    model, cfg = load_model(base, torch.bfloat16, "cpu")
    assert any(isinstance(m, PackedLinear) for m in model.modules())
    model.lora = LoraLayers.attach(model, read_adapters(list(paths.items())), max_rank=16)
    kv, alloc = model_pool(cfg, 64, PAGE_SIZE, torch.bfloat16), PageAllocator(64, 0)
    rows = [None, "attn", "mlp"]
    seqs = [alloc.new_seq(32, PAGE_SIZE) for _ in rows]
    logits = model(replace(make_batch(seqs, [PROMPTS[0]] * 3, PAGE_SIZE), lora_slots=[0, 1, 2]), kv)
    for i, adapter in enumerate(rows):
        want = peft_logits(ref, PROMPTS[0], adapter)
        # bfloat16's rounding against float32's, far below what the adapter moves (over 1 on these logits)
        assert (logits[i] - want).abs().max() < 0.15
        if adapter is not None:
            assert (want - peft_logits(ref, PROMPTS[0], None)).abs().max() > 1


@pytest.mark.parametrize(
    ("modules", "max_loras", "problem"),
    [
        (("a=/x", "b=/y"), 0, "--max-loras 0: must be at least 1"),
        (("a=/x", "a=/y"), 2, "each adapter needs a name of its own"),
        (("a",), 1, "--lora-modules a: expected NAME=PATH"),
    ],
)
def test_adapters_that_cannot_all_be_resident_or_named_are_refused(modules, max_loras, problem):
    with pytest.raises(ConfigError, match=problem):
        LoraConfig(modules=modules, max_loras=max_loras)


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_a_prefill_or_decode_instance_serves_adapters_on_one_rank(setup, role):
    base, paths, _ = setup
    args = [role.value, "--model", str(base), "--lora-modules", f"attn={paths['attn']}"]
    cfg = server_args_from_cli(build_parser().parse_args(args), role, load_env({}))
    assert cfg.engine.lora.adapters == [("attn", str(paths["attn"]))]
    with pytest.raises(ConfigError, match="--lora-modules runs on single-rank instances"):
        server_args_from_cli(build_parser().parse_args([*args, "--tp-size", "2"]), role, load_env({}))


def test_more_adapters_than_slots_wait_for_one_no_running_request_uses_the_least_recently_used_reloaded():
    loads: list[tuple[int, int]] = []
    resident = Resident(max_loras=2, num_adapters=3, load=lambda slot, adapter: loads.append((slot, adapter)))

    def req(adapter: int) -> Req:
        return Req(rid=str(adapter), prompt_ids=[5], params=SamplingParams(), lora_adapter=adapter)

    a, b, c, base = req(1), req(2), req(3), req(0)
    for r in (a, b, base):
        assert resident.fits(r)
        resident.acquire(r)
    assert (a.lora_slot, b.lora_slot, base.lora_slot, loads) == (1, 2, 0, [])  # adapters 1 and 2 start resident
    assert not resident.fits(c) and resident.fits(req(1))  # both slots in use: 3 waits, 1 shares its slot
    resident.release(b)
    resident.release(a)  # slot 1 used last: slot 2 is the least recently used
    assert resident.fits(c)
    resident.acquire(c)
    assert (c.lora_slot, loads) == (2, [(2, 3)])
    again = req(2)
    resident.acquire(again)  # adapter 2 is no longer resident: loaded into the free slot 1
    assert (again.lora_slot, loads[-1]) == (1, (1, 2))
