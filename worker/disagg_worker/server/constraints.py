"""What a request asks its output to follow, as `SamplingParams.grammar` (`engine/grammar.py`).

OpenAI's `response_format` (text, json_object, json_schema) on chat and completions, and SGLang's
extensions: `regex` and `ebnf` beside it, and `json_schema`, `regex`, `ebnf` in /generate's
sampling_params. At most one of them per request. The grammar itself is compiled (and refused with a
400 naming the field) by the scheduler, which holds the tokenizer's vocabulary.
"""

from __future__ import annotations

import json
from typing import Any

from disagg_worker.request.errors import bad_request

# Longest regex or EBNF text accepted; compiling is the scheduler's time, so it is bounded.
MAX_GRAMMAR_CHARS = 64 * 1024


def parse_openai_grammar(body: dict) -> str | None:
    """Chat and completions: `response_format`, `regex` or `ebnf`."""
    text = _text_grammar(body, "response_format", "")
    return text if text is not None else _response_format(body.get("response_format"))


def parse_native_grammar(params: dict, prefix: str) -> str | None:
    """/generate's sampling_params: `json_schema` (a JSON string or an object), `regex` or `ebnf`."""
    text = _text_grammar(params, "json_schema", prefix)
    if text is not None or params.get("json_schema") is None:
        return text
    return _schema(params["json_schema"], prefix + "json_schema")


def _text_grammar(body: dict, json_key: str, prefix: str) -> str | None:
    """`regex` or `ebnf` as a grammar; None when neither is given. At most one of them and `json_key`."""
    given = [k for k in (json_key, "regex", "ebnf") if body.get(k) is not None]
    if len(given) > 1:
        param = prefix + given[1]
        raise bad_request(f"{param}: cannot be combined with {given[0]}; send one of them", param)
    for kind, key in (("regex", "pattern"), ("ebnf", "grammar")):
        if kind in given:
            return _spec(kind, key, _grammar_text(body[kind], prefix + kind))
    return None


def _spec(kind: str, key: str, value: Any) -> str:
    return json.dumps({"type": kind, key: value}, sort_keys=True)


def _grammar_text(v: Any, param: str) -> str:
    if not isinstance(v, str) or not v:
        raise bad_request(f"{param}: must be a non-empty string", param)
    if len(v) > MAX_GRAMMAR_CHARS:
        raise bad_request(f"{param}: at most {MAX_GRAMMAR_CHARS} characters, got {len(v)}", param)
    return v


def _schema(v: Any, param: str) -> str:
    if isinstance(v, str):
        if len(v) > MAX_GRAMMAR_CHARS:
            raise bad_request(f"{param}: at most {MAX_GRAMMAR_CHARS} characters, got {len(v)}", param)
        try:
            v = json.loads(v)
        except ValueError:
            raise bad_request(f"{param}: is not valid JSON", param) from None
    if not isinstance(v, dict):
        raise bad_request(f"{param}: must be a JSON schema (an object)", param)
    return _spec("json_schema", "schema", v)


def _response_format(fmt: Any) -> str | None:
    """OpenAI's response_format: None for text, else the canonical grammar string."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "json_object"})
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        return _schema(spec.get("schema") if isinstance(spec, dict) else None, "response_format.json_schema.schema")
    shown = json.dumps(kind) if isinstance(kind, (str, int, float, bool)) else type(kind).__name__
    what = f"type {shown[:40]}" if kind is not None else "a value without a type"
    raise bad_request(
        f"response_format: {what} is not supported; use text, json_object or json_schema", "response_format"
    )
