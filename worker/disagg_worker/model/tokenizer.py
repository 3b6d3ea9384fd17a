"""Text <-> token ids for a Hugging Face model directory or a GGUF file, and streaming detokenization.

`Tokenizer` wraps the `tokenizers` package (`tokenizer.json`) and reads special tokens and the
chat template from `tokenizer_config.json`, or rebuilds all of it from a GGUF file's metadata
(`gguf_tokenizer.py`). Chat templates are rendered with jinja2 in an immutable sandbox, with the
same globals Hugging Face provides (`raise_exception`, `bos_token`, `eos_token`, `strftime_now`,
the `tojson` filter). A rendered chat already contains its special tokens, so encode it with
`add_special_tokens=False`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from disagg_worker.model.source import find_gguf


@dataclass(frozen=True, eq=False)
class Tokenizer:
    tok: tokenizers.Tokenizer
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool
    chat_template: jinja2.Template | None
    eos_token_ids: tuple[int, ...]
    # The chat template's source, read for the tool-call format it writes (`server/tool_calls.py`).
    chat_template_source: str | None = None

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """The tokenizer of a model: a Hugging Face directory, or a GGUF file (or a directory holding one)."""
        gguf_file = find_gguf(path)
        return cls.from_dir(path) if gguf_file is None else cls.from_gguf(gguf_file)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Read `tokenizer.json` and `tokenizer_config.json`; eos ids also come from `config.json`
        and `generation_config.json` when present."""
        path = Path(path)
        tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        tcfg = _read_json(path / "tokenizer_config.json")
        eos_ids = [i for name in ("config.json", "generation_config.json") for i in _eos_ids(path / name)]
        return cls.from_parts(tok, tcfg, eos_ids, _template_source(path, tcfg))

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Rebuild the tokenizer from a GGUF file's metadata (see `gguf_tokenizer.py`)."""
        from disagg_worker.model.gguf_meta import end_of_turn_ids, open_gguf  # gguf: for GGUF files only
        from disagg_worker.model.gguf_tokenizer import tokenizer_from_gguf

        reader = open_gguf(path)
        tok, tcfg = tokenizer_from_gguf(reader)
        return cls.from_parts(tok, tcfg, end_of_turn_ids(reader), tcfg.get("chat_template"))

    @classmethod
    def from_parts(
        cls, tok: tokenizers.Tokenizer, tcfg: dict[str, Any], eos_ids: list[int], template: str | None
    ) -> Tokenizer:
        """From a `tokenizers` tokenizer, its `tokenizer_config.json` content, the model's eos ids and chat template."""
        bos, eos = _token_text(tcfg.get("bos_token")), _token_text(tcfg.get("eos_token"))
        eos_id = tok.token_to_id(eos) if eos is not None else None
        if eos_id is not None:
            eos_ids = [*eos_ids, eos_id]
        return cls(
            tok=tok,
            bos_token=bos,
            eos_token=eos,
            add_bos_token=bool(tcfg.get("add_bos_token", False)),
            chat_template=_compile(template) if template else None,
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),
            chat_template_source=template or None,
        )

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self.tok.token_to_id(self.bos_token) if self.bos_token else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with special tokens, BOS is prepended if the config asks and the
        tokenizer's own post-processor did not already add it."""
        # encode_batch releases the GIL while it encodes (encode does not): a long text tokenized on a
        # thread leaves the HTTP process's event loop free.
        ids = self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) with the model's chat template.

        Raises ValueError if the model has no chat template or the template rejects the messages.
        """
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use the completions API with a plain prompt")
        return self.chat_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


# Tokens held back (their text ends in U+FFFD) before the detokenizer emits all but the last UNSETTLED_TAIL of
# them: at most 3 bytes of an incomplete UTF-8 character can still change, and they lie in the last few tokens.
HOLD_LIMIT = 16
UNSETTLED_TAIL = 8


class IncrementalDetokenizer:
    """Turns generated ids into text deltas whose concatenation equals decoding them all at once.

    Each step decodes a short window (from the previous emitted boundary) so that tokenizers that
    change leading spaces by context still decode right; text ending in U+FFFD (an incomplete
    multi-byte character) is held back until a later token completes it, or until `flush`.

    Held back, not withheld without bound: tokens that never complete a character (a run of lone bytes, which
    `logit_bias` on byte tokens makes a model emit) would grow the window with every push, each push decoding
    all of it again (quadratic: seconds of the event loop for a few thousand tokens). Past `HOLD_LIMIT` held
    tokens the text of all but the last `UNSETTLED_TAIL` is emitted once decoding everything shows it settled
    (the full text starts with it: no later byte can turn its U+FFFD into a character), so the window, and
    each push's work, stays bounded.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids or [])
        self._read = len(self._ids)
        self._prefix = max(0, self._read - 5)

    def push(self, token_id: int) -> str:
        """Add one generated token; returns the text it completes (possibly empty)."""
        self._ids.append(token_id)
        prefix_text, new_text = self._texts()
        if len(new_text) <= len(prefix_text):
            return ""
        if new_text.endswith("\ufffd"):
            return self._settled(prefix_text, new_text) if len(self._ids) - self._read > HOLD_LIMIT else ""
        self._prefix, self._read = self._read, len(self._ids)
        return new_text[len(prefix_text) :]

    def _settled(self, prefix_text: str, new_text: str) -> str:
        """The text of the held tokens but the last `UNSETTLED_TAIL`, when it can no longer change."""
        upto = len(self._ids) - UNSETTLED_TAIL
        text = self._tokenizer.decode(self._ids[self._prefix : upto], self._skip)
        if len(text) <= len(prefix_text) or not new_text.startswith(text):
            return ""
        self._prefix, self._read = self._read, upto
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes to U+FFFD)."""
        prefix_text, new_text = self._texts()
        self._prefix, self._read = self._read, len(self._ids)
        return new_text[len(prefix_text) :]

    def _texts(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix : self._read], self._skip)
        return prefix_text, decode(self._ids[self._prefix :], self._skip)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(value: str | dict | None) -> str | None:
    """Special tokens are stored either as text or as a serialized AddedToken."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _eos_ids(path: Path) -> list[int]:
    value = _read_json(path).get("eos_token_id")
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _template_source(path: Path, tcfg: dict[str, Any]) -> str | None:
    template = tcfg.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    jinja_file = path / "chat_template.jinja"
    if template is None and jinja_file.exists():
        template = jinja_file.read_text(encoding="utf-8")
    return template


def _raise_exception(message: str) -> None:
    raise ValueError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
