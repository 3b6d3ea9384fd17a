"""The tokenizer of a GGUF file, rebuilt with the `tokenizers` library from its `tokenizer.ggml.*` metadata.

Byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`: GPT-2, SmolLM, Llama 3, Qwen2/3) are
supported; SentencePiece ones (`"llama"`: Llama 2, Mistral) are refused with a message. A GGUF
stores the vocabulary, the merges, each token's type, the special ids and the chat template, but
only names the pre-tokenizer (how text is split before BPE, `tokenizer.ggml.pre`); the split
regexes below are llama.cpp's for each name (`llama-vocab.cpp`). An unknown name is refused rather
than guessed, since a wrong split changes the ids silently. Control tokens (`<|im_start|>`) become
special added tokens (matched whole, skipped when decoding), user-defined ones plain added tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tokenizers
from gguf import GGUFReader
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from disagg_worker.model.gguf_meta import UnsupportedGGUFError, field

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4  # llama.cpp's token types

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    splits: tuple[str, ...]  # applied in order, each match its own piece
    ignore_merges: bool = False  # a word already in the vocabulary is one token (Llama 3)


_ONE_DIGIT_THEN_GPT2 = PreTokenizer((r"\p{N}", _GPT2))
PRE_TOKENIZERS = {
    "default": PreTokenizer((_GPT2,)),
    "gpt-2": PreTokenizer((_GPT2,)),
    "smollm": _ONE_DIGIT_THEN_GPT2,
    "starcoder": _ONE_DIGIT_THEN_GPT2,
    "refact": _ONE_DIGIT_THEN_GPT2,
    "codeshell": _ONE_DIGIT_THEN_GPT2,
    "command-r": _ONE_DIGIT_THEN_GPT2,
    "exaone": _ONE_DIGIT_THEN_GPT2,
    "llama-bpe": PreTokenizer((_LLAMA3,), ignore_merges=True),
    "llama3": PreTokenizer((_LLAMA3,), ignore_merges=True),
    "qwen2": PreTokenizer((_QWEN2,)),
    "deepseek-r1-qwen": PreTokenizer((_QWEN2,)),
}


def tokenizer_from_gguf(reader: GGUFReader) -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
    """The tokenizer and the `tokenizer_config.json` (special tokens, BOS flag, chat template) of the file."""
    kind = field(reader, "tokenizer.ggml.model", None)
    if kind != "gpt2":
        raise UnsupportedGGUFError(
            f"GGUF tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2') vocabularies are"
        )
    pre_name = field(reader, "tokenizer.ggml.pre", "default")
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise UnsupportedGGUFError(
            f"GGUF pre-tokenizer {pre_name!r} is not supported; supported: {', '.join(PRE_TOKENIZERS)}"
        )
    tokens: list[str] = field(reader, "tokenizer.ggml.tokens")
    types: list[int] = field(reader, "tokenizer.ggml.token_type", [NORMAL] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges")]
    vocab = {
        text if ttype in (CONTROL, USER_DEFINED) else byte_level_spelling(text): i
        for i, (text, ttype) in enumerate(zip(tokens, types, strict=True))
    }
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True) if k == CONTROL]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == USER_DEFINED
        ]
    )
    tcfg = _tokenizer_config(reader, tokens)
    bos = tcfg["bos_token"]
    if tcfg["add_bos_token"] and bos is not None:  # as a tokenizer.json says it, so transformers adds it too
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    return tok, tcfg


def _tokenizer_config(reader: GGUFReader, tokens: list[str]) -> dict[str, Any]:
    def text(key: str) -> str | None:
        i = field(reader, f"tokenizer.ggml.{key}_token_id", None)
        return tokens[i] if i is not None else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": text("bos"),
        "eos_token": text("eos"),
        "unk_token": text("unknown"),
        "pad_token": text("padding"),
        "add_bos_token": bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": field(reader, "tokenizer.chat_template", None),
    }


_ALPHABET = frozenset(pre_tokenizers.ByteLevel.alphabet())
_SPELLER = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)


def byte_level_spelling(text: str) -> str:
    """A vocabulary entry in GPT-2's byte alphabet (`Ġ` for a space): as stored when it already is, else its
    UTF-8 bytes spelled out (some converters store such tokens as plain text)."""
    if set(text) <= _ALPHABET:
        return text
    return "".join(piece for piece, _ in _SPELLER.pre_tokenize_str(text))
