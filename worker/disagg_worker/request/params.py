"""What a request asks of sampling, validated; and cutting text at stop strings.

Pure Python (no torch), so the HTTP process and the router can use it; the sampler itself is in
`disagg_worker.engine.sampling`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TypeGuard

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
# Characters of one stop string: the detokenizer holds back up to this much text while it decides.
MAX_STOP_STRING_CHARS = 1024
# Stop token ids of one request: each generated token is checked against them.
MAX_STOP_TOKEN_IDS = 128
# logit_bias: at most this many tokens, each biased by a value in [-LOGIT_BIAS_BOUND, LOGIT_BIAS_BOUND] (OpenAI's).
MAX_LOGIT_BIAS = 1024
LOGIT_BIAS_BOUND = 100.0
# A token id that fits every tensor the sampler builds; the vocabulary bounds it further where it is known.
MAX_TOKEN_ID = 2**31
# Temperatures below this are treated as greedy (dividing by them would overflow).
GREEDY_EPS = 1e-5
# Best tokens considered by top-k/top-p before falling back to sorting the whole vocabulary.
TOP_P_CANDIDATES = 1024
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
# A request's `priority` under --scheduling-policy priority: a signed 32-bit integer, as vLLM's field.
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> TypeGuard[int | float]:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0  # < GREEDY_EPS -> greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 -> disabled
    min_p: float = 0.0
    # Same seed + same prompt -> same output, whatever the batch composition.
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    # (token id, value added to its logit) pairs, applied after the penalties (OpenAI's logit_bias).
    logit_bias: tuple[tuple[int, float], ...] = ()
    ignore_eos: bool = False
    min_new_tokens: int = 0
    # None: no logprobs; 0: the chosen token's; N: plus the top-N alternatives.
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # The prompt's own logprobs (completions' echo): every prompt position gets logits, computed without the
    # prefix cache; `logprobs` alternatives (top-N) too.
    prompt_logprobs: bool = False
    # Constrained output (`engine/grammar.py`): a canonical JSON string such as {"type": "json_object"},
    # {"type": "json_schema", "schema": {...}}, {"type": "regex", "pattern": ...} or {"type": "ebnf",
    # "grammar": ...}; None: free text.
    grammar: str | None = None
    # The LoRA adapter the request runs under (a --lora-modules name, selected by the request's `model`); "": the
    # base model. It travels with the parameters, which every hop carries.
    lora: str = ""
    # Its place in the waiting queue under --scheduling-policy priority (`engine/waiting.py`): a higher value is
    # admitted first (vLLM's `priority` field, whose order there is the opposite: lower first); ignored under fcfs.
    # Not a sampling parameter, but it travels with them, as `lora` does.
    priority: int = 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def problem(self, vocab_size: int | None = None) -> str:
        """What `validate` finds wrong ("" if nothing)."""
        try:
            self.validate(vocab_size)
        except ValueError as e:
            return str(e)
        return ""

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError("<field>: <what is wrong>") for the first out-of-range field; with `vocab_size`,
        token ids (top_k, stop_token_ids, logit_bias) are also checked against the vocabulary."""
        for f in fields(self):
            problem = _CHECKS[f.name](getattr(self, f.name))
            if problem:
                raise ValueError(f"{f.name}: {problem}")
        self._check_vocab(vocab_size)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                "min_new_tokens: must not exceed the maximum number of new tokens "
                f"({self.max_new_tokens}), got {_fmt(self.min_new_tokens)}"
            )

    def _check_vocab(self, vocab: int | None) -> None:
        if self.top_k > (vocab or MAX_TOKEN_ID):
            size = f" ({vocab})" if vocab else ""
            raise ValueError(f"top_k: must be at most the vocabulary size{size} or -1, got {_fmt(self.top_k)}")
        if vocab is None:
            return
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", [t for t, _ in self.logit_bias])):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise ValueError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab})")


def _fmt(v: object) -> str:
    if _is_int(v) and abs(v) >= 10**40:
        return "a huge integer"
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _int_range(lo: int | None, hi: int | None, optional: bool = False):
    def check(v: object) -> str | None:
        if v is None and optional:
            return None
        if not _is_int(v):
            return f"must be an integer, got {_fmt(v)}"
        if lo is not None and v < lo:
            return f"must be >= {lo}, got {_fmt(v)}"
        if hi is not None and v > hi:
            return f"must be <= {hi}, got {_fmt(v)}"
        return None

    return check


def _real_range(lo: float, hi: float, lo_open: bool = False):
    def check(v: object) -> str | None:
        if not _is_real(v):
            return f"must be a finite number, got {_fmt(v)}"
        if v < lo or (lo_open and v == lo):
            return f"must be {'>' if lo_open else '>='} {lo}, got {_fmt(v)}"
        if v > hi:
            return f"must be <= {hi}, got {_fmt(v)}"
        return None

    return check


def _check_bool(v: object) -> str | None:
    return None if isinstance(v, bool) else f"must be a boolean, got {_fmt(v)}"


def _check_stop(v: object) -> str | None:
    if not isinstance(v, tuple) or not all(isinstance(s, str) and s for s in v):
        return "must be a tuple of non-empty strings"
    if len(v) > MAX_STOP_STRINGS:
        return f"at most {MAX_STOP_STRINGS} stop strings, got {len(v)}"
    longest = max((len(s) for s in v), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        return f"each stop string must be at most {MAX_STOP_STRING_CHARS} characters, got one of {longest}"
    return None


def _check_grammar(v: object) -> str | None:
    return None if v is None or isinstance(v, str) else f"must be a JSON string or None, got {_fmt(v)}"


def _check_text(v: object) -> str | None:
    return None if isinstance(v, str) else f"must be a string, got {_fmt(v)}"


def _check_stop_ids(v: object) -> str | None:
    if not isinstance(v, tuple) or not all(_is_int(t) and 0 <= t < MAX_TOKEN_ID for t in v):
        return "must be a tuple of non-negative token ids"
    if len(v) > MAX_STOP_TOKEN_IDS:
        return f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(v)}"
    return None


def _check_logit_bias(v: object) -> str | None:
    if not isinstance(v, tuple) or not all(isinstance(p, tuple) and len(p) == 2 for p in v):
        return "must be a map of token ids to biases"
    if len(v) > MAX_LOGIT_BIAS:
        return f"at most {MAX_LOGIT_BIAS} tokens, got {len(v)}"
    for token, bias in v:
        if not _is_int(token) or not 0 <= token < MAX_TOKEN_ID:
            return f"keys must be token ids (non-negative integers), got {_fmt(token)}"
        if not _is_real(bias) or abs(bias) > LOGIT_BIAS_BOUND:
            return f"the bias of token {token} must be a number in [-100, 100], got {_fmt(bias)}"
    return None


def _check_top_k(v: object) -> str | None:
    if not _is_int(v) or v < -1:
        return f"must be -1 (disabled), 0 (disabled) or a positive integer, got {_fmt(v)}"
    return None  # its upper bound is the vocabulary's (`SamplingParams._check_vocab`)


_CHECKS = {
    "max_new_tokens": _int_range(1, None),
    "temperature": _real_range(0.0, 2.0),
    "top_p": _real_range(0.0, 1.0, lo_open=True),
    "top_k": _check_top_k,
    "min_p": _real_range(0.0, 1.0),
    "seed": _int_range(_SEED_MIN, _SEED_MAX, optional=True),
    "frequency_penalty": _real_range(-2.0, 2.0),
    "presence_penalty": _real_range(-2.0, 2.0),
    "repetition_penalty": _real_range(0.0, math.inf, lo_open=True),
    "stop": _check_stop,
    "stop_token_ids": _check_stop_ids,
    "logit_bias": _check_logit_bias,
    "ignore_eos": _check_bool,
    "min_new_tokens": _int_range(0, None),
    "logprobs": _int_range(0, MAX_LOGPROBS, optional=True),
    "skip_special_tokens": _check_bool,
    "prompt_logprobs": _check_bool,
    "grammar": _check_grammar,
    "lora": _check_text,
    "priority": _int_range(PRIORITY_MIN, PRIORITY_MAX),
}


class StopChecker:
    """Cuts streamed text at the stop string that completes first.

    "First" means the earliest end (the longest string when several end together), so the result
    does not depend on how the text is split into deltas.

    `push(delta)` returns the text that is safe to emit now and whether a stop string was hit.
    Text that could be the start of a stop string is held back until the next delta decides;
    `flush()` returns it at the end of the stream. After a hit, nothing more is emitted and the
    stop string itself is never emitted.
    """

    def __init__(self, stop: tuple[str, ...]):
        if any(not s for s in stop):
            raise ValueError("stop: stop strings must be non-empty")
        self._stop = tuple(stop)
        self._held = ""
        self._hit = False

    @property
    def stopped(self) -> bool:
        return self._hit

    def push(self, delta: str) -> tuple[str, bool]:
        if self._hit:
            return "", True
        text = self._held + delta
        hits = [(i + len(s), i) for s in self._stop if (i := text.find(s)) >= 0]
        if hits:
            self._hit, self._held = True, ""
            return text[: min(hits)[1]], True
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if s.startswith(text[len(text) - n :]):
                    best = n
                    break
        return best
