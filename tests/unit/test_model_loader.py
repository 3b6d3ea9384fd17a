"""Loading Hugging Face directories: sharded checkpoints, tied heads, dtypes, clear errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from disagg_worker.model import loader
from disagg_worker.model.cpu_linear import PackedLinear, can_pack
from disagg_worker.model.loader import WeightMismatchError, load_model
from tests.unit.model_stubs import PageAllocator, make_batch, model_pool

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROMPT = [5, 17, 300, 42, 9, 1500, 77, 8]

pytest_plugins = ["tests.unit.conftest_model"]


def last_logits(model, cfg) -> torch.Tensor:
    kv = model_pool(cfg, num_pages=8, page_size=4, dtype=next(model.parameters()).dtype)
    seq = PageAllocator(8).new_seq(len(PROMPT), 4)
    return model(make_batch([seq], [PROMPT], 4), kv)[0]


def copy_with_weights(src, dst, weights: dict[str, torch.Tensor]):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    save_file(weights, str(dst / "model.safetensors"))
    return dst


def test_sharded_checkpoint_loads_to_identical_logits(tiny_dirs, tmp_path):
    src = tiny_dirs["llama"]
    weights = load_file(str(src / "model.safetensors"))
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    sharded = tmp_path / "sharded"
    shutil.copytree(src, sharded, ignore=shutil.ignore_patterns("model.safetensors"))
    for shard, shard_names in shards.items():
        save_file({n: weights[n] for n in shard_names}, str(sharded / shard))
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    single, cfg = load_model(src, "float32", "cpu")
    split, _ = load_model(sharded, "float32", "cpu")
    assert torch.equal(last_logits(single, cfg), last_logits(split, cfg))


def test_missing_tensor_is_named_in_the_error(tiny_dirs, tmp_path):
    weights = load_file(str(tiny_dirs["llama"] / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    path = copy_with_weights(tiny_dirs["llama"], tmp_path / "m", weights)
    with pytest.raises(WeightMismatchError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        load_model(path, "float32", "cpu")


def test_unexpected_tensor_is_named_in_the_error(tiny_dirs, tmp_path):
    weights = load_file(str(tiny_dirs["llama"] / "model.safetensors"))
    weights["model.layers.7.self_attn.q_proj.weight"] = torch.zeros(2, 2)
    path = copy_with_weights(tiny_dirs["llama"], tmp_path / "m", weights)
    with pytest.raises(WeightMismatchError, match=r"unexpected tensors \['model.layers.7.self_attn.q_proj.weight'\]"):
        load_model(path, "float32", "cpu")


def test_tied_head_uses_the_embedding_even_if_the_checkpoint_stores_it(tiny_dirs, tmp_path):
    weights = load_file(str(tiny_dirs["qwen2"] / "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    path = copy_with_weights(tiny_dirs["qwen2"], tmp_path / "m", weights)
    model, cfg = load_model(path, "float32", "cpu")
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    reference, _ = load_model(tiny_dirs["qwen2"], "float32", "cpu")
    torch.testing.assert_close(last_logits(model, cfg), last_logits(reference, cfg), atol=1e-6, rtol=0)


def test_bfloat16_model_returns_float32_logits_close_to_float32(tiny_dirs):
    fp32, cfg = load_model(tiny_dirs["qwen3"], "float32", "cpu")
    bf16, _ = load_model(tiny_dirs["qwen3"], torch.bfloat16, "cpu")
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    got, want = last_logits(bf16, cfg), last_logits(fp32, cfg)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=0.05, rtol=0)
    assert got.argmax() == want.argmax()


@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16), reason="no oneDNN bfloat16 on this CPU")
def test_bfloat16_linears_are_packed_on_the_cpu_with_logits_bitwise_equal(tiny_dirs, monkeypatch):
    for arch in ("llama", "qwen3"):
        packed, cfg = load_model(tiny_dirs[arch], torch.bfloat16, "cpu")
        kinds = {type(m) for m in packed.modules()}
        assert PackedLinear in kinds and torch.nn.Linear not in kinds, kinds
        with monkeypatch.context() as m:
            m.setattr(loader, "can_pack", lambda device, dtype: False)
            plain, _ = load_model(tiny_dirs[arch], torch.bfloat16, "cpu")
        assert PackedLinear not in {type(m) for m in plain.modules()}
        assert torch.equal(last_logits(packed, cfg), last_logits(plain, cfg))
    fp32, _ = load_model(tiny_dirs["llama"], "float32", "cpu")
    assert PackedLinear not in {type(m) for m in fp32.modules()}  # float32 rounding would change


def test_progress_bar_only_for_large_models(tiny_dirs, capfd, monkeypatch):
    load_model(tiny_dirs["llama"], "float32", "cpu")
    assert "loading weights" not in capfd.readouterr().err
    monkeypatch.setattr(loader, "PROGRESS_MIN_BYTES", 0)
    load_model(tiny_dirs["llama"], "float32", "cpu")
    assert "loading weights" in capfd.readouterr().err


def test_directory_without_weights_is_a_clear_error(tiny_dirs, tmp_path):
    path = tmp_path / "empty"
    shutil.copytree(tiny_dirs["llama"], path, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(path, "float32", "cpu")


def test_a_hugging_face_model_loads_and_tokenizes_without_gguf(tiny_model):
    """gguf (llama.cpp's format) is needed for GGUF files only: an image or machine without it serves a Hugging
    Face directory. Any import of gguf raises in this process."""
    code = f"""
import sys
sys.modules["gguf"] = None
from disagg_worker.model.loader import load_model
from disagg_worker.model.tokenizer import Tokenizer
model, cfg = load_model({tiny_model!r}, "float32", "cpu")
print(cfg.vocab_size, len(Tokenizer.from_path({tiny_model!r}).encode("hello")) > 0)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(load_model(tiny_model, "float32", "cpu")[1].vocab_size), "True"]
