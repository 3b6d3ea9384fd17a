"""Reading a GGUF file's metadata with `gguf.GGUFReader`; no torch, so the HTTP process can use it too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGUFReader

# Token texts that end a turn besides the ids a file names (eos, eot, eom), as llama.cpp reads them.
END_OF_TURN_TEXTS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


class UnsupportedGGUFError(ValueError):
    """The file uses something this engine cannot run (architecture, quantisation type, tokenizer)."""


def open_gguf(path: str | Path) -> GGUFReader:
    try:
        return GGUFReader(path, "r")
    except ValueError as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def field(reader: GGUFReader, key: str, *default: Any) -> Any:
    """A metadata value as Python data (strings, numbers, lists); `default` if given and absent, else KeyError."""
    f = reader.fields.get(key)
    if f is not None:
        return f.contents()
    if default:
        return default[0]
    raise KeyError(f"the GGUF file has no metadata key {key!r}")


def end_of_turn_ids(reader: GGUFReader) -> list[int]:
    """The ids that end generation: eos, eot and eom as the file names them, and the tokens whose text
    marks an end of turn (`<|im_end|>`, `<|endoftext|>`, ...), as llama.cpp decides."""
    named = [field(reader, f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
    ids = {text: i for i, text in enumerate(field(reader, "tokenizer.ggml.tokens", []))}
    by_text = [ids[t] for t in END_OF_TURN_TEXTS if t in ids]
    return list(dict.fromkeys(i for i in [*named, *by_text] if i is not None))
