"""`disagg model convert-gguf`: a GGUF file written out as a Hugging Face directory.

The directory holds `config.json`, `generation_config.json`, `model.safetensors` (the dequantised
weights, float32 unless asked otherwise), `tokenizer.json` and `tokenizer_config.json` (special
tokens and chat template): the same config, weights and tokenizer that loading the GGUF directly
produces, in the form the safetensors loader maps without parsing or dequantising anything. `make
serve` converts its demo model once this way, because every process that loads a GGUF pays for
parsing it (see `gguf_model.py`). transformers loads the directory too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from disagg_worker.model import gguf_model
from disagg_worker.model.gguf_meta import open_gguf
from disagg_worker.model.gguf_tokenizer import tokenizer_from_gguf
from disagg_worker.model.loader import gguf_config, read_gguf
from disagg_worker.model.source import find_gguf


def convert_gguf(src: str | Path, out: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write the model of the GGUF file `src` (or of the directory holding it) to `out`; returns `out`.

    `config.json` is written last, so a directory that has one is complete.
    """
    gguf_file = find_gguf(src)
    if gguf_file is None:
        raise FileNotFoundError(f"no GGUF file at {src}")
    reader = open_gguf(gguf_file)
    state = read_gguf(reader, gguf_file, gguf_config(reader), dtype, torch.device("cpu"))
    tok, tokenizer_config = tokenizer_from_gguf(reader)
    config = {**gguf_model.hf_config(reader), "torch_dtype": str(dtype).removeprefix("torch.")}
    dest = Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(dest / "model.safetensors"), {"format": "pt"})
    tok.save(str(dest / "tokenizer.json"))
    tokenizer_config["model_max_length"] = config["max_position_embeddings"]
    _write_json(dest / "tokenizer_config.json", tokenizer_config)
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    _write_json(dest / "generation_config.json", generation)
    _write_json(dest / "config.json", config)
    return dest


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
