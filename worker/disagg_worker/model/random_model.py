"""A random-weight model of a real model's shape, in Hugging Face layout: what a GPU benchmark needs without a
download or a licence, where the tiny model (`tiny.py`) is too small for its figures to mean anything.

`make_random(out_dir, "llama-3.1-8b")` writes `config.json` (the named shape's: Llama-3.1-8B's sizes, rotary
base and llama3 rotary scaling), safetensors weights drawn on the given device in the given dtype and saved
shard by shard under a `model.safetensors.index.json`, as the Hub lays out large checkpoints (so the peak
memory is one shard, not the model), and the tiny model's tokenizer padded to the shape's vocabulary. The
padding tokens are byte-level strings (`<r1234>`) that no merge produces: prompts tokenise as with the tiny
model, but every id the model can sample decodes, and the embedding and the head have their real size.
Answers are gibberish; time per token is the real model's. New shapes go in `model.shapes`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from disagg_worker.model.config import ModelConfig
from disagg_worker.model.registry import build_model
from disagg_worker.model.shapes import SHAPES
from disagg_worker.model.tiny import (
    BOS_ID,
    EOS_ID,
    IM_END_ID,
    VOCAB_SIZE,
    tokenizer_config,
    train_tokenizer,
    write_json,
)

WEIGHT_STD = 0.02  # Llama's initializer_range (`shapes`)
SHARD_BYTES = 4 * 2**30  # the Hub's checkpoints come in files of a few GB


def make_random(
    out_dir: str | Path,
    shape: str,
    dtype: str = "bfloat16",
    device: str = "cpu",
    seed: int = 0,
    shard_bytes: int = SHARD_BYTES,
) -> Path:
    """Write the model of the named `shape` with random weights to `out_dir` (created if needed); returns it."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # The tokenizer's ids, not Llama's 128000...: the tokenizer written beside it is the tiny model's, padded.
    hf_config = {**SHAPES[shape], "bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID], "torch_dtype": dtype}
    write_json(out / "config.json", hf_config)
    write_json(out / "generation_config.json", {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID]})
    write_json(out / "tokenizer_config.json", tokenizer_config(hf_config))
    padded_tokenizer(hf_config["vocab_size"]).save(str(out / "tokenizer.json"))
    shapes = parameter_shapes(ModelConfig.from_hf_dict(hf_config))
    write_weights(out, shapes, getattr(torch, dtype), torch.device(device), seed, shard_bytes)
    return out


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the loader expects of `cfg`'s model, in the model's order (a tied head once)."""
    with torch.device("meta"):
        return {name: tuple(p.shape) for name, p in build_model(cfg).named_parameters()}


def plan_shards(shapes: dict[str, tuple[int, ...]], itemsize: int, shard_bytes: int) -> list[list[str]]:
    """The tensors of each file, in order: a file is closed before the tensor that would take it past
    `shard_bytes` (a tensor larger than that gets a file of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = itemsize * _numel(shape)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_weights(
    out: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device, seed: int, shard_bytes: int
) -> None:
    """Draw each file's tensors on `device` (normal(0, WEIGHT_STD), norms near 1), save it, then free it; one
    file is `model.safetensors`, more are `model-0000i-of-0000n.safetensors` under an index."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shards = plan_shards(shapes, torch.empty((), dtype=dtype).element_size(), shard_bytes)
    names = ["model.safetensors"] if len(shards) == 1 else [_shard_name(i, len(shards)) for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    total = 0
    for file, tensors in zip(names, shards, strict=True):
        state = {name: _draw(name, shapes[name], dtype, device, gen) for name in tensors}
        total += sum(t.numel() * t.element_size() for t in state.values())
        save_file(state, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        del state
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def padded_tokenizer(vocab_size: int) -> Tokenizer:
    """The tiny model's trained byte-level BPE, its vocabulary filled up to `vocab_size` with tokens no merge
    makes (`<r{id}>`, printable ASCII, which byte-level decoding gives back as written)."""
    tok = train_tokenizer(min(vocab_size, VOCAB_SIZE))
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise ValueError("the trained vocabulary's ids are not 0..n-1: padding it would leave holes")
    for i in range(len(vocab), vocab_size):
        vocab[f"<r{i}>"] = i
    return Tokenizer.from_str(json.dumps(spec))


def _draw(
    name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> torch.Tensor:
    noise = torch.randn(shape, generator=gen, device=device, dtype=dtype) * WEIGHT_STD
    return (noise + 1.0 if "norm" in name else noise).cpu()


def _shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
