"""Which file a `--model` path names, and the model name clients see by default."""

from __future__ import annotations

import pytest

from disagg_worker.config import EngineConfig
from disagg_worker.model.source import find_gguf, served_name


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("/models/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
        ("llama-2-7b-chat.Q4_K_M.gguf", "llama-2-7b-chat"),
        ("qwen2.5-0.5b-instruct-q8_0.gguf", "qwen2.5-0.5b-instruct"),
        ("Phi-3-mini-4k-instruct-IQ2_XXS.gguf", "Phi-3-mini-4k-instruct"),
        ("tinyllama-BF16.gguf", "tinyllama"),
        ("model.f16.gguf", "model"),
        ("plain.gguf", "plain"),
        ("Q4_0.gguf", "Q4_0"),
        ("/models/Qwen3-0.6B/", "Qwen3-0.6B"),
        (".models/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct"),
    ],
)
def test_served_name_drops_the_quantisation_label(path, name):
    assert served_name(path) == name
    assert EngineConfig(model_path=path).model_name == name
    assert EngineConfig(model_path=path, served_model_name="mine").model_name == "mine"


def test_find_gguf(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "stray.gguf").write_bytes(b"")
    assert find_gguf(hf) is None  # a Hugging Face directory wins over a stray file
    one = tmp_path / "one"
    one.mkdir()
    (one / "m.Q8_0.gguf").write_bytes(b"")
    assert find_gguf(one) == one / "m.Q8_0.gguf"
    assert find_gguf(one / "m.Q8_0.gguf") == one / "m.Q8_0.gguf"
    (one / "m.F16.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"several GGUF files \(m\.F16\.gguf, m\.Q8_0\.gguf\)"):
        find_gguf(one)
    assert find_gguf(tmp_path / "missing") is None
