"""Load a model's weights: a Hugging Face directory (`config.json` plus `model.safetensors` or a
sharded `model.safetensors.index.json`) or a GGUF file (`gguf_model.py`; a directory holding one
`.gguf` and no `config.json` counts as the file). Tensor names must match the model's exactly (a
tied `lm_head` may be absent or present; rotary `inv_freq` buffers are ignored); anything missing or
unexpected is an error that lists the names.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from gguf import GGUFReader
from safetensors import safe_open
from tqdm import tqdm

from disagg_worker.model import gguf_model
from disagg_worker.model.config import ModelConfig
from disagg_worker.model.gguf_meta import open_gguf
from disagg_worker.model.llama import LlamaForCausalLM
from disagg_worker.model.source import find_gguf

PROGRESS_MIN_BYTES = 200 * 1024 * 1024
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightMismatchError(ValueError):
    """The checkpoint's tensors do not match the model built from its config."""


def load_model(
    path: str | Path, dtype: torch.dtype | str, device: torch.device | str
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model from the checkpoint's config and fill it with its weights.

    Returns the model in eval mode, without gradients, on `device` in `dtype`.
    """
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        cfg, state = read_gguf(open_gguf(gguf_file), gguf_file, dtype, torch.device(device))
    else:
        cfg, state = _read_hf_dir(Path(path), dtype, torch.device(device))
    model = _empty_model(cfg)
    model.load_state_dict(state, strict=False, assign=True)  # names were checked; a tied head is re-tied
    model.tie_weights()
    return model.to(device).eval().requires_grad_(False), cfg


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory, single-file or sharded."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def _empty_model(cfg: ModelConfig) -> LlamaForCausalLM:
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def _expected_names(cfg: ModelConfig) -> set[str]:
    return {name for name, _ in _empty_model(cfg).named_parameters()}


def _read_hf_dir(path: Path, dtype: torch.dtype, device: torch.device) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg = ModelConfig.from_hf_dir(path)
    names_by_file = _tensor_names(path)
    expected = _expected_names(cfg)
    _check_names(expected, {n for names in names_by_file.values() for n in names}, cfg)
    return cfg, _read(names_by_file, expected, dtype, device)


def read_gguf(
    reader: GGUFReader, path: Path, dtype: torch.dtype, device: torch.device
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and dequantised weights of an open GGUF file; the architecture, quantisation types and
    tensor names are all checked before anything is dequantised."""
    cfg = ModelConfig.from_hf_dict(gguf_model.hf_config(reader))
    gguf_model.check_tensor_types(reader, path)
    _check_names(_expected_names(cfg), set(gguf_model.tensor_names(reader).values()), cfg)
    progress = gguf_model.dequantized_nbytes(reader) >= PROGRESS_MIN_BYTES
    return cfg, gguf_model.read_weights(reader, cfg, dtype, device, progress=progress)


def _tensor_names(path: Path) -> dict[Path, list[str]]:
    names: dict[Path, list[str]] = {}
    for file in weight_files(path):
        with safe_open(file, framework="pt") as f:
            names[file] = [k for k in f.keys() if not k.endswith(_IGNORED_SUFFIXES)]
    return names


def _check_names(expected: set[str], found: set[str], cfg: ModelConfig) -> None:
    if cfg.tie_word_embeddings:
        found = found - {"lm_head.weight"}
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        raise WeightMismatchError(
            f"checkpoint does not match the {cfg.arch} model: "
            f"missing tensors {missing}, unexpected tensors {unexpected}"
        )


def _read(
    names_by_file: dict[Path, list[str]], expected: set[str], dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    total_bytes = sum(f.stat().st_size for f in names_by_file)
    total = sum(len(n) for n in names_by_file.values())
    state: dict[str, torch.Tensor] = {}
    with tqdm(total=total, desc="loading weights", unit="tensor", disable=total_bytes < PROGRESS_MIN_BYTES) as bar:
        for file, names in names_by_file.items():
            with safe_open(file, framework="pt", device=str(device)) as f:
                for name in names:
                    if name in expected:  # a tied head stored anyway is skipped
                        state[name] = f.get_tensor(name).to(dtype)
                    bar.update(1)
    return state
