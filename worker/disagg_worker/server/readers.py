"""Readers: one JSON value of a request body -> one Python value of the right type, or a 400 naming `param`.

Pure functions shared by the request parsers (`protocol.py`); whatever the value holds (wrong types, bools
where integers go, NaN, huge numbers, lone surrogates), they return a value or raise `APIError`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from disagg_worker.request.errors import bad_request
from disagg_worker.request.limits import RequestLimits
from disagg_worker.request.params import MAX_LOGIT_BIAS, MAX_TOKEN_ID


def read_int(v: Any, param: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"{param}: must be an integer, got {show(v)}", param)
    return v


def read_real(v: Any, param: str) -> float:
    try:
        ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(float(v))
    except OverflowError:
        ok = False
    if not ok:
        raise bad_request(f"{param}: must be a finite number, got {show(v)}", param)
    return float(v)


def read_bool(v: Any, param: str) -> bool:
    if not isinstance(v, bool):
        raise bad_request(f"{param}: must be a boolean, got {show(v)}", param)
    return v


def read_text(v: Any, param: str) -> str:
    if not isinstance(v, str):
        raise bad_request(f"{param}: must be a string, got {show(v)}", param)
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"{param}: is not valid Unicode text", param) from None
    return v


def read_stop(v: Any, param: str) -> tuple[str, ...]:
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise bad_request(f"{param}: must be a non-empty string or a list of them", param)
    return tuple(read_text(s, param) for s in items)


def read_token_list(v: Any, param: str, limits: RequestLimits) -> list[int]:
    """A list of token ids; whether they are in the vocabulary is `limits`' to say."""
    if not isinstance(v, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < MAX_TOKEN_ID for t in v
    ):
        raise bad_request(f"{param}: must be a list of token ids in [0, {limits.token_id_bound})", param)
    return v


def read_token_ids(v: Any, param: str, limits: RequestLimits) -> tuple[int, ...]:
    ids = read_token_list(v, param, limits)
    limits.check_token_ids(ids, param)
    return tuple(ids)


def read_logit_bias(v: Any, param: str) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: an object mapping token ids (as strings) to biases; the ranges are SamplingParams'."""
    if not isinstance(v, dict):
        raise bad_request(f"{param}: must be an object mapping token ids to biases", param)
    if len(v) > MAX_LOGIT_BIAS:
        raise bad_request(f"{param}: at most {MAX_LOGIT_BIAS} tokens, got {len(v)}", param)
    pairs = []
    for key, bias in v.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise bad_request(f"{param}: keys must be token ids, got {show(key)}", param)
        pairs.append((int(key), read_real(bias, f"{param}.{key}")))
    return tuple(sorted(pairs))


def show(v: Any) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**40:
        return "a huge integer"
    text = json.dumps(v) if isinstance(v, (str, int, float, bool, type(None))) else type(v).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def optional(body: dict, key: str, read: Callable[[Any, str], Any], default: Any, prefix: str = "") -> Any:
    v = body.get(key)
    return default if v is None else read(v, prefix + key)
