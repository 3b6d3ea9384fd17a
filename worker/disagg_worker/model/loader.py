"""Load a model's weights: a Hugging Face directory (`config.json` plus `model.safetensors` or a
sharded `model.safetensors.index.json`) or a GGUF file (`gguf_model.py`; a directory holding one
`.gguf` and no `config.json` counts as the file). Tensor names must match the model's exactly (a
tied `lm_head` may be absent or present; rotary `inv_freq` buffers are ignored); anything missing or
unexpected is an error that lists the names.

Under tensor or pipeline parallelism (`shard`) each rank reads only its slice of each tensor
(`model.parallel.shard_slice`): from safetensors through its lazy slices, so no rank materialises the
model; from a GGUF file a rank dequantises only the tensors it holds part of, then slices them.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from tqdm import tqdm

from disagg_worker.model.config import ModelConfig
from disagg_worker.model.cpu_linear import can_pack, pack_linears
from disagg_worker.model.decoder import CausalLM, Collectives
from disagg_worker.model.formats import WeightFormat, weight_format
from disagg_worker.model.merged import merge_projections
from disagg_worker.model.moe import keeps_fp32
from disagg_worker.model.parallel import Shard, check_parallel, shard_slice
from disagg_worker.model.registry import build_model
from disagg_worker.model.source import find_gguf

if TYPE_CHECKING:
    from gguf import GGUFReader

log = logging.getLogger(__name__)
PROGRESS_MIN_BYTES = 200 * 1024 * 1024
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


class WeightMismatchError(ValueError):
    """The checkpoint's tensors do not match the model built from its config."""


def load_model(
    path: str | Path,
    dtype: torch.dtype | str,
    device: torch.device | str,
    shard: Shard | None = None,
    comm: Collectives | None = None,
    quantization: str = "",
) -> tuple[CausalLM, ModelConfig]:
    """Build the model (this rank's `shard` of it) from the checkpoint's config and fill it with its
    weights.

    Returns the model in eval mode, without gradients, on `device` in `dtype` (bfloat16 linear layers on a
    CPU with their weights packed for oneDNN: `cpu_linear.py`), held in the weight format `quantization` names
    (`formats/`: "" keeps them as loaded, "int4" holds the projections in 4 bits); on CUDA, on a single tensor
    rank, q/k/v and gate/up each run as one GEMM (`merged.py`) where the format leaves them plain.
    """
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    shard = shard or Shard()
    gguf_file = find_gguf(path)
    reader = _open_gguf(gguf_file) if gguf_file is not None else None
    cfg = gguf_config(reader) if reader is not None else ModelConfig.from_hf_dir(Path(path))
    problem = check_parallel(cfg, shard.tp_size, shard.pp_size, shard.ep_size, shard.dp_size)
    if problem:
        raise ValueError(f"cannot split {Path(path).name} over the instance's ranks: {problem}")
    with torch.device("meta"):
        model = build_model(cfg, shard, comm)
    mine = {name for name, _ in model.named_parameters()}
    if reader is not None and gguf_file is not None:
        state = read_gguf(reader, gguf_file, cfg, dtype, torch.device(device), shard, mine)
    else:
        state = _read_hf_dir(Path(path), cfg, mine, shard, dtype, torch.device(device))
    model.load_state_dict(state, strict=False, assign=True)  # names were checked; a tied head is re-tied
    del state  # the parameters are its tensors: quantising below frees each 16-bit weight as it goes
    model.tie_weights()
    model = model.to(device).eval().requires_grad_(False)
    model.finish_load()
    fit_to_device(model, torch.device(device), dtype, shard, weight_format(quantization))
    return model, cfg


def fit_to_device(model: CausalLM, device: torch.device, dtype: torch.dtype, shard: Shard, fmt: WeightFormat) -> None:
    """The forms a loaded model's projections take for its device: its weight format's (4 bits for int4), then
    packed for oneDNN (what is left in bfloat16 on a CPU), or merged q/k/v and gate/up (CUDA, one tensor rank, a
    format that leaves them plain linear layers)."""
    fmt.apply(model, dtype)
    if can_pack(device, dtype):
        pack_linears(model)
    if device.type == "cuda" and shard.tp_size == 1 and fmt.merges_projections:
        log.info("merged q/k/v and gate/up projections of %d modules", merge_projections(model))


def model_config(path: str | Path) -> ModelConfig:
    """The config of the model at `path` (a Hugging Face directory or a GGUF file), without its weights."""
    gguf_file = find_gguf(path)
    return gguf_config(_open_gguf(gguf_file)) if gguf_file is not None else ModelConfig.from_hf_dir(Path(path))


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


def _expected_names(cfg: ModelConfig) -> set[str]:
    """Every parameter of the whole model (all ranks together)."""
    with torch.device("meta"):
        return {name for name, _ in build_model(cfg).named_parameters()}


def _read_hf_dir(
    path: Path, cfg: ModelConfig, mine: set[str], shard: Shard, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    names_by_file = _tensor_names(path, cfg)
    _check_names(_expected_names(cfg), {n for names in names_by_file.values() for n in names}, cfg)
    return _read(names_by_file, mine, cfg, shard, dtype, device)


def _open_gguf(path: Path) -> GGUFReader:
    from disagg_worker.model.gguf_meta import open_gguf  # gguf is needed for GGUF files only

    return open_gguf(path)


def gguf_config(reader: GGUFReader) -> ModelConfig:
    """The model config of an open GGUF file."""
    from disagg_worker.model import gguf_model

    return ModelConfig.from_hf_dict(gguf_model.hf_config(reader))


def read_gguf(
    reader: GGUFReader,
    path: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    shard: Shard | None = None,
    mine: set[str] | None = None,
) -> dict[str, torch.Tensor]:
    """The dequantised weights of an open GGUF file (the parameters in `mine`, each sliced to what `shard`
    holds; default: all of them, whole); quantisation types and tensor names are checked before anything
    is dequantised."""
    from disagg_worker.model import gguf_model

    gguf_model.check_tensor_types(reader, path)
    expected = _expected_names(cfg)
    _check_names(expected, set(gguf_model.tensor_names(reader).values()), cfg)
    shard, mine = shard or Shard(), expected if mine is None else mine

    def where(name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        return shard_slice(name, shape, cfg, shard) if name in mine else None

    progress = gguf_model.dequantized_nbytes(reader) >= PROGRESS_MIN_BYTES
    return gguf_model.read_weights(reader, cfg, dtype, device, where, progress=progress)


def _tensor_names(path: Path, cfg: ModelConfig) -> dict[Path, list[str]]:
    """The checkpoint's tensors, less rotary buffers and layers past the decoder's (DeepSeek-V3 ships its
    next-token-prediction layer as `model.layers.<num_hidden_layers>`)."""
    names: dict[Path, list[str]] = {}
    for file in weight_files(path):
        with safe_open(file, framework="pt") as f:
            names[file] = [k for k in f.keys() if not k.endswith(_IGNORED_SUFFIXES) and not _past_decoder(k, cfg)]
    return names


def _past_decoder(name: str, cfg: ModelConfig) -> bool:
    m = _LAYER_INDEX.match(name)
    return m is not None and cfg.num_layers <= int(m.group(1)) < cfg.num_layers + cfg.nextn_layers


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
                    if name in expected:  # a tied head stored anyway is skipped
                        part = f.get_slice(name)
                        where = shard_slice(name, tuple(part.get_shape()), cfg, shard)
                        if where is not None:
                            state[name] = part[where].to(torch.float32 if keeps_fp32(name, cfg.moe) else dtype)
                    bar.update(1)
    return state
