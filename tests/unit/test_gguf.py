"""GGUF files load into the same model and tokenizer as the Hugging Face directory they were written from."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from disagg_worker.cli import main as cli
from disagg_worker.model.config import ModelConfig
from disagg_worker.model.gguf_meta import UnsupportedGGUFError
from disagg_worker.model.loader import WeightMismatchError, load_model
from disagg_worker.model.parallel import Shard
from disagg_worker.model.tiny import random_weights
from disagg_worker.model.tokenizer import Tokenizer
from tests.unit.gguf_stubs import gguf_name, llama_cpp_permute, random_quant_bytes, write_gguf
from tests.unit.model_stubs import DENSE_ARCHS

Q = GGMLQuantizationType
TEXTS = [
    "The lighthouse keeper climbed the stairs.",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u2014 \u201cquoted\u201d \u6771\u4eac and \U0001f680 rockets, 2024",
    "  leading spaces, tabs\tand\nnewlines  ",
    "<|im_start|>user\nhi<|im_end|>\n",
]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]

pytest_plugins = ["tests.unit.conftest_model"]


def hf_model(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((path / "config.json").read_text()), load_file(path / "model.safetensors")


@pytest.fixture(scope="module")
def ggufs(tiny_dirs, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    return {
        arch: write_gguf(root / f"tiny-{arch}.F32.gguf", *hf_model(tiny_dirs[arch]), tokenizer_dir=tiny_dirs[arch])
        for arch in DENSE_ARCHS
    }


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    pa, pb = params(a), params(b)
    assert pa.keys() == pb.keys()
    differ = [n for n in pa if not torch.equal(pa[n], pb[n])]
    assert not differ, differ


@pytest.mark.parametrize("arch", DENSE_ARCHS)
def test_f32_gguf_loads_the_weights_and_config_of_the_directory(ggufs, tiny_dirs, arch):
    ours, cfg = load_model(ggufs[arch], "float32", "cpu")
    ref, ref_cfg = load_model(tiny_dirs[arch], "float32", "cpu")
    assert_same_params(ours, ref)
    assert cfg.rms_norm_eps == pytest.approx(ref_cfg.rms_norm_eps)  # GGUF stores it as float32
    assert replace(cfg, rms_norm_eps=ref_cfg.rms_norm_eps) == ref_cfg


@pytest.mark.parametrize(
    "shard", [Shard(tp_rank=1, tp_size=2), Shard(pp_rank=1, pp_size=2)], ids=["tp-rank-1-of-2", "pp-stage-1-of-2"]
)
def test_a_rank_reads_the_same_slice_of_a_gguf_as_of_the_directory(ggufs, tiny_dirs, shard):
    ours, _ = load_model(ggufs["llama"], "float32", "cpu", shard)
    ref, _ = load_model(tiny_dirs["llama"], "float32", "cpu", shard)
    assert_same_params(ours, ref)
    whole, _ = load_model(ggufs["llama"], "float32", "cpu")
    assert sum(p.numel() for p in ours.parameters()) < sum(p.numel() for p in whole.parameters())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # transformers reads no head_dim for qwen3
def test_transformers_reads_the_test_files_as_we_do(ggufs, arch):
    """Our files and reader agree with an independent reader: transformers' GGUF loader."""
    path = ggufs[arch]
    ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    ours, _ = load_model(path, "float32", "cpu")
    theirs = ref.state_dict()
    differ = [n for n, p in params(ours).items() if not torch.equal(p, theirs[n])]
    assert not differ, differ


def hf_rows_of(deq: np.ndarray, name: str, cfg: dict) -> np.ndarray:
    """The Hugging Face row order of a dequantised llama Q/K matrix (inverting llama.cpp's row permutation)."""
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    kind = next((k for k in heads if f".{k}." in name), None)
    if kind is None:
        return deq
    source_row = llama_cpp_permute(np.arange(deq.shape[0]).reshape(-1, 1), heads[kind]).ravel()
    out = np.empty_like(deq)
    out[source_row] = deq
    return out


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0], ids=lambda q: q.name)
def test_quantised_tensors_load_as_gguf_dequantises_them(tiny_dirs, tmp_path, qtype):
    config, weights = hf_model(tiny_dirs["llama"])
    path = write_gguf(tmp_path / f"tiny.{qtype.name}.gguf", config, weights, qtype=qtype)
    ours = params(load_model(path, "float32", "cpu")[0])
    quantised = 0
    for name, w in weights.items():
        arr = w.numpy()
        if arr.ndim == 2 and arr.shape[-1] % GGML_QUANT_SIZES[qtype][0] == 0:  # norms and odd rows stay F32
            gguf_rows = llama_cpp_permute(arr, config["num_attention_heads"]) if "q_proj" in name else arr
            gguf_rows = llama_cpp_permute(arr, config["num_key_value_heads"]) if "k_proj" in name else gguf_rows
            raw = gguf_rows.astype(np.float16) if qtype == Q.F16 else quantize(gguf_rows, qtype)
            arr = hf_rows_of(dequantize(raw, qtype), name, config)
            assert not np.array_equal(arr, w.numpy())  # the file holds the quantised values
            quantised += 1
        np.testing.assert_array_equal(ours[name].numpy(), arr, err_msg=name)
    assert quantised >= 6 * config["num_hidden_layers"]  # q, k, v, o, gate, up (down's 344-wide rows stay F32)


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda q: q.name)
def test_k_quant_tensors_load_as_gguf_dequantises_them(tmp_path, qtype):
    """K-quants come in 256-value blocks; gguf-py reads them but cannot write them, so the blocks are random."""
    config = {
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }
    shapes = {n: w.shape for n, w in random_weights(ModelConfig.from_hf_dict(config), seed=0).items()}
    norms = {n: torch.ones(s) for n, s in shapes.items() if len(s) == 1}
    raw = {n: random_quant_bytes(s[0], s[1], qtype, seed=i) for i, (n, s) in enumerate(shapes.items()) if len(s) == 2}
    path = write_gguf(
        tmp_path / "k.gguf", config, norms, raw_tensors={gguf_name(n): (b, qtype) for n, b in raw.items()}
    )
    ours = params(load_model(path, "float32", "cpu")[0])
    for name, blocks in raw.items():
        expected = hf_rows_of(dequantize(blocks, qtype), name, config)
        assert ours[name].shape == shapes[name]
        np.testing.assert_array_equal(ours[name].numpy(), expected, err_msg=name)


def test_an_unsupported_quantisation_type_is_refused_with_its_name(tiny_dirs, tmp_path):
    config, weights = hf_model(tiny_dirs["llama"])
    up = weights.pop("model.layers.0.mlp.up_proj.weight")
    raw = {"blk.0.ffn_up.weight": (random_quant_bytes(up.shape[0], up.shape[1], Q.IQ4_NL), Q.IQ4_NL)}
    path = write_gguf(tmp_path / "tiny.IQ4_NL.gguf", config, weights, raw_tensors=raw)
    with pytest.raises(
        UnsupportedGGUFError, match=r"quantisation type IQ4_NL, which this engine cannot load.*blk\.0\.ffn_up"
    ):
        load_model(path, "float32", "cpu")


def test_missing_and_unknown_tensors_are_named(tiny_dirs, tmp_path):
    config, weights = hf_model(tiny_dirs["llama"])
    del weights["model.layers.1.mlp.down_proj.weight"]
    raw = {"blk.0.mystery.weight": (np.zeros((4, 4), dtype=np.float32), Q.F32)}
    path = write_gguf(tmp_path / "tiny.gguf", config, weights, raw_tensors=raw)
    with pytest.raises(WeightMismatchError, match=r"model\.layers\.1\.mlp\.down_proj\.weight.*blk\.0\.mystery\.weight"):
        load_model(path, "float32", "cpu")


def test_an_unsupported_architecture_is_refused_with_its_name(tiny_dirs, tmp_path):
    config, weights = hf_model(tiny_dirs["llama"])
    path = write_gguf(tmp_path / "phi.gguf", {**config, "model_type": "phi3"}, weights)
    with pytest.raises(UnsupportedGGUFError, match="architecture 'phi3'"):
        load_model(path, "float32", "cpu")


@pytest.mark.parametrize("arch", DENSE_ARCHS)
def test_gguf_tokenizer_matches_the_directory_tokenizer(ggufs, tiny_dirs, arch):
    ours, ref = Tokenizer.from_path(ggufs[arch]), Tokenizer.from_dir(tiny_dirs[arch])
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.apply_chat_template(MESSAGES) == ref.apply_chat_template(MESSAGES)
    assert (ours.bos_token, ours.eos_token, ours.vocab_size) == (ref.bos_token, ref.eos_token, ref.vocab_size)
    assert ours.eos_token_ids == ref.eos_token_ids == (1, 3)  # </s>, and <|im_end|> that ends a turn


def tokenizer_only_gguf(path: Path, model: str, pre: str) -> Path:
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(["a", "b", "ab"])
    w.add_token_merges(["a b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    ("model", "pre", "message"),
    [("llama", "default", "tokenizer model 'llama'"), ("gpt2", "mystery-bpe", "pre-tokenizer 'mystery-bpe'")],
)
def test_an_unsupported_tokenizer_is_refused_with_its_name(tmp_path, model, pre, message):
    with pytest.raises(UnsupportedGGUFError, match=message):
        Tokenizer.from_path(tokenizer_only_gguf(tmp_path / "t.gguf", model, pre))


def test_convert_gguf_writes_a_directory_that_loads_the_same(ggufs, tmp_path):
    src = ggufs["llama"]
    assert cli(["model", "convert-gguf", str(src), "--out", str(tmp_path / "hf")]) == 0
    ours, cfg = load_model(tmp_path / "hf", "float32", "cpu")
    direct, direct_cfg = load_model(src, "float32", "cpu")
    assert_same_params(ours, direct)
    assert cfg == direct_cfg
    converted, from_gguf = Tokenizer.from_path(tmp_path / "hf"), Tokenizer.from_path(src)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in TEXTS:
        assert converted.encode(text) == from_gguf.encode(text) == hf_tok(text).input_ids, text
    assert converted.apply_chat_template(MESSAGES) == from_gguf.apply_chat_template(MESSAGES)
    assert converted.eos_token_ids == from_gguf.eos_token_ids


def test_a_directory_holding_one_gguf_is_that_file(ggufs, tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "m.gguf").symlink_to(ggufs["qwen3"])
    assert_same_params(
        load_model(tmp_path / "model", "float32", "cpu")[0], load_model(ggufs["qwen3"], "float32", "cpu")[0]
    )
