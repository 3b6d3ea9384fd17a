"""make_random: a real model's shape with random weights, in files the engine's loader reads, sharded as the Hub
shards, with a tokenizer of the shape's vocabulary. Tests write the "-mini" shape, never the 16 GB one."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from disagg_worker.cli import main
from disagg_worker.config import CacheConfig, EngineConfig, SchedulerConfig
from disagg_worker.engine.assemble import load_engine
from disagg_worker.engine.sampling import SamplingParams
from disagg_worker.model.config import ModelConfig
from disagg_worker.model.loader import load_model, weight_files
from disagg_worker.model.random_model import make_random, parameter_shapes, plan_shards
from disagg_worker.model.shapes import SHAPES
from disagg_worker.model.tokenizer import Tokenizer
from tests.unit.test_engine import run_all

MINI = "llama-3.1-8b-mini"


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    """The mini shape in files of at most 1 MiB (its 2 MiB embedding and head get a file each)."""
    return make_random(tmp_path_factory.mktemp("mini"), MINI, dtype="bfloat16", seed=3, shard_bytes=2**20)


def test_the_8b_shape_is_llama_3_1_8bs():
    cfg = ModelConfig.from_hf_dict(SHAPES["llama-3.1-8b"])
    shapes = parameter_shapes(cfg)
    assert sum(torch.Size(s).numel() for s in shapes.values()) == 8_030_261_248  # Llama-3.1-8B's parameter count
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (32, 32, 8, 128, 128256)
    assert (cfg.rope_theta, cfg.rope_scaling["rope_type"], cfg.max_position_embeddings) == (500000.0, "llama3", 131072)
    files = plan_shards(shapes, 2, 4 * 2**30)
    assert len(files) == 4 and [n for f in files for n in f] == list(shapes)  # 16 GB in bfloat16, in order


def test_the_files_are_sharded_under_an_index_that_names_every_tensor_once(mini):
    index = json.loads((mini / "model.safetensors.index.json").read_text())
    files = weight_files(mini)
    assert len(files) > 2 and {f.name for f in files} == set(index["weight_map"].values())
    cfg = ModelConfig.from_hf_dir(mini)
    expected = parameter_shapes(cfg)
    found = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            found |= {k: tuple(st.get_slice(k).get_shape()) for k in st.keys()}
            assert len(st.keys()) == 1 or f.stat().st_size <= 2**20 + 4096  # a file over the limit holds one tensor
    assert found == expected and set(index["weight_map"]) == set(expected)
    assert index["metadata"]["total_size"] == 2 * sum(torch.Size(s).numel() for s in expected.values())


def test_the_loader_reads_it_as_the_shape_says(mini):
    model, cfg = load_model(mini, torch.bfloat16, "cpu")
    shape = SHAPES[MINI]
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads, cfg.vocab_size) == (256, 2, 1, shape["vocab_size"])
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.torch_dtype == "bfloat16"
    weights = dict(model.named_parameters())  # (bfloat16 projections are packed for oneDNN on a CPU)
    embedding, norm = weights["model.embed_tokens.weight"], weights["model.layers.0.input_layernorm.weight"]
    assert embedding.dtype == torch.bfloat16 and 0.015 < embedding.float().std().item() < 0.025  # drawn, not zeros
    assert 0.95 < norm.float().mean().item() < 1.05


def test_the_tokenizer_has_the_shapes_vocabulary_and_decodes_every_id(mini):
    tok = Tokenizer.from_dir(mini)
    assert tok.vocab_size == SHAPES[MINI]["vocab_size"]
    assert tok.tok.decode([4000]) == "<r4000>"
    assert tok.tok.decode(tok.tok.encode("hello world").ids[1:]) == "hello world"


def test_the_engine_serves_it(mini):
    cfg = EngineConfig(
        model_path=str(mini), cache=CacheConfig(page_size=16), scheduler=SchedulerConfig(enable_overlap=False)
    )
    engine = load_engine(cfg)
    params = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    outs = run_all(engine, [(list(range(10, 40)), params)], overlap=False)
    assert len([t for o in outs["0"] for t in o.token_ids]) == 5
    engine.close()


def test_the_command_writes_a_named_shape_and_refuses_an_unknown_one(tmp_path, capsys):
    assert main(["model", "make-random", "--shape", MINI, "--out", str(tmp_path / "m"), "--seed", "1"]) == 0
    assert ModelConfig.from_hf_dir(tmp_path / "m").vocab_size == SHAPES[MINI]["vocab_size"]
    assert [f.name for f in weight_files(tmp_path / "m")] == ["model.safetensors"]  # under 4 GiB: one file
    with pytest.raises(SystemExit):
        main(["model", "make-random", "--shape", "gpt-5", "--out", str(tmp_path / "x")])
    assert "invalid choice: 'gpt-5'" in capsys.readouterr().err
