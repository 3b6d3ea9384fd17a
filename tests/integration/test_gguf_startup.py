"""A GGUF file the engine cannot run stops `disagg serve` at start-up, with a message naming what."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.integration.procs import DISAGG, free_port, scaled
from tests.unit.gguf_stubs import Q, random_quant_bytes, write_gguf

pytestmark = pytest.mark.integration


def test_an_unsupported_quantisation_type_stops_start_up_naming_it(tiny_model, tmp_path):
    model = Path(tiny_model)
    config = json.loads((model / "config.json").read_text())
    weights = load_file(model / "model.safetensors")
    up = weights.pop("model.layers.0.mlp.up_proj.weight")
    raw = {"blk.0.ffn_up.weight": (random_quant_bytes(up.shape[0], up.shape[1], Q.IQ4_NL), Q.IQ4_NL)}
    path = write_gguf(tmp_path / "tiny.IQ4_NL.gguf", config, weights, tokenizer_dir=model, raw_tensors=raw)
    out = subprocess.run(
        [DISAGG, "serve", "--model", str(path), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=scaled(180),
    )
    assert out.returncode != 0
    assert "quantisation type IQ4_NL, which this engine cannot load" in out.stderr, out.stderr[-3000:]
    assert "blk.0.ffn_up.weight" in out.stderr
