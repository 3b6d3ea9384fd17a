"""Constrained output: JSON (any object, or one that follows a schema), a regular expression or an
EBNF grammar, enforced token by token with xgrammar.

The HTTP process turns a request's `response_format`, `regex` or `ebnf` into `SamplingParams.grammar`,
a canonical JSON string (`{"type": "json_object"}`, `{"type": "json_schema", "schema": {...}}`,
`{"type": "regex", "pattern": ...}`, `{"type": "ebnf", "grammar": ...}`). In the scheduler process
`Grammars.matcher` compiles it (once per distinct string; JSON with fixed separators, no free
whitespace, so a small model cannot loop on blanks) into a matcher the request's `SamplingState`
owns. Each step the sampler masks the logits of rows with a matcher to the tokens the grammar allows
(`mask_rows`) and feeds it the chosen token (`accept_rows`); the grammar allows end-of-sequence only
where its text is complete, so the request stops there. Under P/D prefill samples the first token under
the mask and decode's matcher accepts that token (`SamplingState.resume_after`) before its own steps.

Compiling runs on a thread beside the scheduler loop (`Grammars.submit`), as SGLang's and vLLM's grammar
backends do: the engine holds the request until its grammar is ready, refuses it (400) when compiling
fails or takes longer than `grammar_compile_limit_s`, and fails it alone (500) when the compiler raises
anything else.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache
from typing import Any

import torch

from disagg_worker.tuning import TUNING

# Threads compiling grammars: one pathological grammar (compilation cannot be cancelled) leaves the other to serve.
GRAMMAR_THREADS = 2


class CompilerBusy(Exception):
    """The grammar compiler's queue is full: the request is refused with a 503, nothing held against its grammar."""


def new_matcher(compiled: Any) -> Any:
    """A request's own matcher of a compiled grammar (cheap: the masks are the compiled grammar's)."""
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled)


class CompileFault(Exception):
    """Raised by an injected fault (`EngineConfig.fault_grammar_pattern`): a type no compiler raises."""


class Grammars:
    """Compiles response formats for one model's tokenizer; the tokenizer is read on first use.

    `submit` compiles on threads of their own (GRAMMAR_THREADS), so a slow grammar never stalls the scheduler's
    steps; requests with the same grammar share one compilation, and compiled grammars are kept in a bounded LRU
    cache. A grammar whose compilation ran past the loop's limit is remembered (`give_up`) and refused at once
    afterwards."""

    def __init__(
        self,
        model_path: str,
        vocab_size: int,
        stop_ids: Sequence[int],
        cache_entries: int = TUNING.engine.grammar_cache_entries,
        fault_pattern: str = "",
        queue_entries: int = TUNING.engine.grammar_queue_entries,
    ):
        self.model_path, self.vocab_size, self.stop_ids = model_path, vocab_size, list(stop_ids)
        self.cache_entries = cache_entries
        self.queue_entries = queue_entries
        self.fault_pattern = fault_pattern
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._too_slow: OrderedDict[str, None] = OrderedDict()
        self._pending: dict[str, Future] = {}  # compilations queued or running, shared by their requests
        self._started: dict[str, float] = {}  # when a running compilation began (after the tokenizer was read)
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, grammar: str) -> Future:
        """A future of `grammar` compiled (`new_matcher` makes each request's matcher of it): done at once when
        cached or refused, shared with the requests already waiting for the same grammar."""
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
            pending = self._pending.get(grammar)
            too_slow = grammar in self._too_slow
        if compiled is not None or too_slow:
            done: Future = Future()
            if too_slow:
                done.set_exception(ValueError(self._too_slow_message(grammar)))
            else:
                done.set_result(compiled)
            return done
        if pending is not None:
            return pending
        if len(self._pending) >= self.queue_entries:
            busy: Future = Future()
            busy.set_exception(CompilerBusy(f"{len(self._pending)} grammars are compiling or queued; retry later"))
            return busy
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=GRAMMAR_THREADS, thread_name_prefix="grammar")
        future = self._pool.submit(self.compiled, grammar)
        with self._lock:
            self._pending[grammar] = future
        future.add_done_callback(lambda _: self._forget_pending(grammar))
        return future

    def _forget_pending(self, grammar: str) -> None:
        with self._lock:
            self._pending.pop(grammar, None)
            self._started.pop(grammar, None)

    def cancel(self, grammar: str, future: Future) -> bool:
        """No request waits for `grammar`'s compilation any more: drop it if it has not started (one running is
        left to finish, and cached: xgrammar's compile cannot be interrupted)."""
        return future.cancel()  # its done callback forgets it as pending

    def compiling_for(self, grammar: str) -> float | None:
        """Seconds `grammar`'s compilation has been running; None while it waits for a thread."""
        with self._lock:
            started = self._started.get(grammar)
        return None if started is None else time.monotonic() - started

    def give_up(self, grammar: str) -> str:
        """`grammar` did not compile in time: refuse it at once from now on; the 400's message."""
        with self._lock:
            self._too_slow[grammar] = None
            while len(self._too_slow) > self.cache_entries:
                self._too_slow.popitem(last=False)
        return self._too_slow_message(grammar)

    def matcher(self, grammar: str) -> Any:
        """A fresh `xgrammar.GrammarMatcher` for `grammar`, compiled here if needed; ValueError naming the request
        field if it won't compile (the client's error). Any other exception is a failure of the compiler."""
        return new_matcher(self.compiled(grammar))

    def compiled(self, grammar: str) -> Any:
        """`grammar` compiled (from the cache, or now on this thread)."""
        with self._lock:
            if grammar in self._too_slow:
                raise ValueError(self._too_slow_message(grammar))
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return compiled
        compiled = self._compile(grammar)
        with self._lock:
            self._compiled[grammar] = compiled
            while len(self._compiled) > self.cache_entries:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, grammar: str) -> Any:
        spec = json.loads(grammar)
        kind = spec.get("type")
        if kind not in _KINDS:
            raise ValueError(f"grammar: unknown type {str(kind)[:40]!r}")
        compiler = self.compiler()  # the first use reads the tokenizer: not the grammar's time
        with self._lock:
            self._started[grammar] = time.monotonic()
        if self.fault_pattern and kind == "regex" and spec.get("pattern") == self.fault_pattern:
            raise CompileFault("injected grammar compiler fault")
        param, compile_spec = _KINDS[kind]
        try:
            return compile_spec(compiler, spec)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"{param}: {_WHAT[kind]} cannot be used: {str(e)[:300]}") from None

    def _too_slow_message(self, grammar: str) -> str:
        kind = json.loads(grammar).get("type")
        param = _KINDS[kind][0] if kind in _KINDS else "grammar"
        limit = TUNING.engine.grammar_compile_limit_s
        return f"{param}: {_WHAT.get(kind, 'the grammar')} did not compile within {limit:g} s; simplify it"

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def compiler(self) -> Any:
        with self._compiler_lock:  # two grammar threads may ask for it first at once
            if self._compiler is None:
                self._compiler = self._make_compiler()
        return self._compiler

    def _make_compiler(self) -> Any:
        import xgrammar as xgr

        from disagg_worker.model.tokenizer import Tokenizer

        tok = Tokenizer.from_path(self.model_path).tok
        vocab = [""] * self.vocab_size  # ids past the tokenizer's (padding rows) are never allowed
        for piece, i in tok.get_vocab(with_added_tokens=True).items():
            if i < self.vocab_size:
                vocab[i] = piece
        kind, prefix_space = vocab_type(json.loads(tok.to_str()))
        info = xgr.TokenizerInfo(
            vocab,
            getattr(xgr.VocabType, kind),
            vocab_size=self.vocab_size,
            stop_token_ids=self.stop_ids,
            add_prefix_space=prefix_space,
        )
        return xgr.GrammarCompiler(info)


def _json(compiler: Any, schema: dict) -> Any:
    return compiler.compile_json_schema(json.dumps(bounded_strings_as_patterns(schema)), any_whitespace=False)


_VALUES = ("const", "enum", "default", "examples")  # keywords whose contents are JSON values, not schemas


def bounded_strings_as_patterns(schema: Any) -> Any:
    """`schema` with each string bounded by minLength/maxLength (and no pattern or format of its own)
    spelled as the equivalent pattern of non-control characters.

    xgrammar 0.2.8 compiles a length-bounded string to a grammar that lets raw control characters
    (tab, U+0001, ...) into the string and refuses escapes, so an answer could be invalid JSON that
    `json.loads` refuses; its pattern strings are escaped correctly. The pattern keeps the bounds
    and leaves out control characters, which a JSON string can only hold escaped."""
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _VALUES else bounded_strings_as_patterns(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and "pattern" not in out and "format" not in out:
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^[^\\x00-\\x1f]{{{lo},{hi}}}$"
    return out


def _tool_calls(compiler: Any, spec: dict) -> Any:
    """One call of one of `spec["tools"]`, its arguments (under `arguments_key`) following that tool's
    parameters schema, between the `begin` and `end` text of the template's call format (which
    `server/tool_calls.py` knows)."""
    import xgrammar as xgr

    key = spec["arguments_key"]
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t["name"]}, key: t["parameters"]},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t in spec["tools"]
    ]
    schema = bounded_strings_as_patterns(calls[0] if len(calls) == 1 else {"anyOf": calls})
    parts = [xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)]
    if spec["begin"]:
        parts.insert(0, xgr.Grammar.from_ebnf(f"root ::= {json.dumps(spec['begin'], ensure_ascii=False)}"))
    if spec["end"]:
        parts.append(xgr.Grammar.from_ebnf(f"root ::= {json.dumps(spec['end'], ensure_ascii=False)}"))
    return compiler.compile_grammar(xgr.Grammar.concat(*parts) if len(parts) > 1 else parts[0])


# Grammar type -> (the request field a failure names, how it compiles).
_KINDS: dict[str, tuple[str, Callable[[Any, dict], Any]]] = {
    "json_object": ("response_format", lambda c, spec: _json(c, {"type": "object"})),
    "json_schema": ("response_format", lambda c, spec: _json(c, spec["schema"])),
    "regex": ("regex", lambda c, spec: c.compile_regex(spec["pattern"])),
    "ebnf": ("ebnf", lambda c, spec: c.compile_grammar(spec["grammar"])),
    "tool_calls": ("tools", _tool_calls),
}
_WHAT = {
    "json_object": "JSON",
    "json_schema": "the JSON schema",
    "regex": "the pattern",
    "ebnf": "the grammar",
    "tool_calls": "a parameters schema",
}


def vocab_type(tokenizer_json: dict) -> tuple[str, bool]:
    """How a `tokenizers` vocabulary spells bytes, as xgrammar's VocabType name, and whether encoding
    adds a leading space: byte-level BPE (GPT-2 style), SentencePiece with byte fallback, or raw."""
    decoder = tokenizer_json.get("decoder") or {}
    kinds = {d.get("type") for d in decoder.get("decoders") or [decoder]}
    if "ByteLevel" in kinds:
        return "BYTE_LEVEL", False
    if "ByteFallback" in kinds:
        return "BYTE_FALLBACK", True
    return "RAW", False


def mask_rows(logits: torch.Tensor, matchers: Sequence[Any]) -> torch.Tensor:
    """`logits` [B, vocab] with every token the row's matcher forbids at -inf (a copy; rows without a
    matcher, or whose grammar already ended, are unchanged)."""
    rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
    if not rows:
        return logits
    import xgrammar as xgr

    out = logits.float().contiguous().clone()
    bitmask = _bitmask(len(matchers), out.shape[1])
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    # The masks are filled on the CPU (xgrammar's matchers write host memory); applied where the logits are.
    xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device, non_blocking=True), indices=rows)
    return out


def accept_rows(matchers: Sequence[Any], tokens: Sequence[int]) -> None:
    for m, t in zip(matchers, tokens, strict=True):
        if m is not None and not m.is_terminated():
            m.accept_token(t)


@cache
def _bitmask_template(batch: int, vocab: int) -> torch.Tensor:
    import xgrammar as xgr

    with torch.inference_mode(False):  # a normal tensor: reused in and out of inference mode
        return xgr.allocate_token_bitmask(batch, vocab)


def _bitmask(batch: int, vocab: int) -> torch.Tensor:
    return _bitmask_template(batch, vocab).fill_(-1)  # all allowed until a matcher fills its row
