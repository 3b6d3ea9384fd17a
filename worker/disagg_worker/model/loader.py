"""Load a Hugging Face model directory: `config.json` plus `model.safetensors` or a sharded
`model.safetensors.index.json`. Tensor names must match the model's exactly (a tied `lm_head` may be
absent or present; rotary `inv_freq` buffers are ignored); anything missing or unexpected is an
error that lists the names.

Under tensor or pipeline parallelism (`shard`) each rank reads only its slice of each tensor
(`model.parallel.shard_slice`, through safetensors' lazy slices), so no rank materialises the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from disagg_worker.model.config import ModelConfig
from disagg_worker.model.llama import AllReduce, LlamaForCausalLM
from disagg_worker.model.parallel import Shard, check_parallel, shard_slice

PROGRESS_MIN_BYTES = 200 * 1024 * 1024
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class WeightMismatchError(ValueError):
    """The checkpoint's tensors do not match the model built from its config."""


def load_model(
    path: str | Path,
    dtype: torch.dtype | str,
    device: torch.device | str,
    shard: Shard | None = None,
    all_reduce: AllReduce | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model (this rank's `shard` of it) from `<path>/config.json` and fill it with the
    checkpoint's weights.

    Returns the model in eval mode, without gradients, on `device` in `dtype`.
    """
    path = Path(path)
    cfg = ModelConfig.from_hf_dir(path)
    shard = shard or Shard()
    problem = check_parallel(cfg, shard.tp_size, shard.pp_size)
    if problem:
        raise ValueError(f"cannot split {path.name} over the instance's ranks: {problem}")
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        whole = {name for name, _ in LlamaForCausalLM(cfg).named_parameters()}
        model = LlamaForCausalLM(cfg, shard, all_reduce)
    names_by_file = _tensor_names(path)
    _check_names(whole, names_by_file, cfg)
    mine = {name for name, _ in model.named_parameters()}
    state = _read(names_by_file, mine, cfg, shard, dtype, torch.device(device))
    model.load_state_dict(state, strict=False, assign=True)  # names were checked above; a tied head is re-tied
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


def _tensor_names(path: Path) -> dict[Path, list[str]]:
    names: dict[Path, list[str]] = {}
    for file in weight_files(path):
        with safe_open(file, framework="pt") as f:
            names[file] = [k for k in f.keys() if not k.endswith(_IGNORED_SUFFIXES)]
    return names


def _check_names(expected: set[str], names_by_file: dict[Path, list[str]], cfg: ModelConfig) -> None:
    found = {n for names in names_by_file.values() for n in names}
    if cfg.tie_word_embeddings:
        found.discard("lm_head.weight")
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        raise WeightMismatchError(
            f"checkpoint does not match the {cfg.arch} model: "
            f"missing tensors {missing}, unexpected tensors {unexpected}"
        )


def _read(
    names_by_file: dict[Path, list[str]],
    expected: set[str],
    cfg: ModelConfig,
    shard: Shard,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """The `expected` tensors, each sliced to what `shard` holds (a tied head reads the embedding)."""
    total_bytes = sum(f.stat().st_size for f in names_by_file)
    total = sum(len(n) for n in names_by_file.values())
    state: dict[str, torch.Tensor] = {}
    with tqdm(total=total, desc="loading weights", unit="tensor", disable=total_bytes < PROGRESS_MIN_BYTES) as bar:
        for file, names in names_by_file.items():
            with safe_open(file, framework="pt", device=str(device)) as f:
                for name in names:
                    if name in expected:
                        part = f.get_slice(name)
                        where = shard_slice(name, tuple(part.get_shape()), cfg, shard)
                        if where is not None:
                            state[name] = part[where].to(dtype)
                    bar.update(1)
    return state
