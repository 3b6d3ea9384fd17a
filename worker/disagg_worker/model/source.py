"""Where a model comes from: a Hugging Face directory or a GGUF file, and the name it is served under.

Pure path logic (no torch, no gguf), so the configuration chain and the router can use it.
"""

from __future__ import annotations

import re
from pathlib import Path

GGUF_SUFFIX = ".gguf"
# The quantisation label llama.cpp's tools append to a file name: `.Q4_1`, `-Q4_K_M`, `-IQ2_XXS`, `.f16`, `-BF16`.
_QUANT_LABEL = re.compile(r"[.\-_](?:I?Q\d\w*|B?F16|F32)$", re.IGNORECASE)


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one `.gguf` of a directory without `config.json`.

    None for a Hugging Face directory. Raises ValueError for a directory holding several GGUF files
    (which one to load is the user's choice, not ours).
    """
    p = Path(path)
    if p.is_file():
        return p
    if not p.is_dir() or (p / "config.json").exists():
        return None
    found = sorted(p.glob(f"*{GGUF_SUFFIX}"))
    if len(found) > 1:
        names = ", ".join(f.name for f in found)
        raise ValueError(f"{p} holds several GGUF files ({names}); pass the one to serve with --model")
    return found[0] if found else None


def served_name(model_path: str) -> str:
    """The model name clients see by default: the directory's name, or the GGUF file's without its
    quantisation label (`SmolLM2-135M-Instruct.Q4_1.gguf` -> `SmolLM2-135M-Instruct`)."""
    p = Path(model_path.rstrip("/"))
    if p.suffix.lower() == GGUF_SUFFIX:
        return _QUANT_LABEL.sub("", p.stem) or p.stem
    return p.name
