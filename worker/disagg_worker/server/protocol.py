"""Parsing and validating request bodies: OpenAI completions and chat, and the native /generate.

Pure functions from a decoded JSON body to a frozen request dataclass. Whatever the body holds
(wrong types, nested garbage, bools where integers go, NaN, huge numbers), they either return a
request or raise `APIError` with a 4xx status and `param` naming the offending field. Unknown
fields are ignored, as OpenAI does. A missing or null `model` means the served model.

Default `max_new_tokens`: 16 for completions and /generate (OpenAI's completions default); for
chat, up to DEFAULT_CHAT_MAX_TOKENS. A default is shrunk to the room left in the context once
the prompt length is known (`RequestLimits.fit`); an explicit value that does not fit is a 400.
Every rule that depends on the model (vocabulary, context, KV capacity) is `RequestLimits`'s.
`priority` (an integer, higher first under --scheduling-policy priority) is a field of the body itself on every
endpoint, /generate's too (beside `sampling_params`, as SGLang's), and rides with the sampling parameters.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any

from disagg_worker.request.errors import bad_request, model_not_found
from disagg_worker.request.limits import RequestLimits
from disagg_worker.request.params import PRIORITY_MAX, PRIORITY_MIN, SamplingParams
from disagg_worker.server.constraints import parse_native_grammar, parse_openai_grammar
from disagg_worker.server.readers import (
    optional,
    read_bool,
    read_int,
    read_logit_bias,
    read_real,
    read_stop,
    read_text,
    read_token_ids,
    read_token_list,
    show,
)
from disagg_worker.server.tool_calls import ToolUse, message_tool_calls, parse_tool_use

DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 1024
MAX_N = 16
# The choices one completions request may ask for: its prompts times n. lm-evaluation-harness sends its
# `batch_size` prompts in one request, so MAX_N alone would stop its batches of 32 or 64; each choice is one engine
# request behind the request's single admission slot, so this bounds that slot at four times what n alone holds.
MAX_BATCH_CHOICES = 4 * MAX_N
CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt: str | list[int]
    sampling: SamplingParams
    stream: bool = False
    stream_options_include_usage: bool = False
    echo: bool = False
    n: int = 1
    user: str | None = None
    # False when max_new_tokens is the default, which `RequestLimits.fit` may shrink.
    max_tokens_set: bool = False
    echo_only: bool = False  # `max_tokens: 0` with echo (log-likelihood scoring): the prompt is the answer
    param: str = "prompt"  # what errors call this prompt: `prompt[i]` in a batch


@dataclass(frozen=True)
class ChatRequest:
    model: str
    # Normalised: {"role": str, "content": str} plus "name" when given; text parts are joined.
    messages: list[dict]
    sampling: SamplingParams
    stream: bool = False
    stream_options_include_usage: bool = False
    n: int = 1
    add_generation_prompt: bool = True
    user: str | None = None
    max_tokens_set: bool = False
    tools: ToolUse | None = None  # tools offered to the model (`tool_calls.py`)


@dataclass(frozen=True)
class GenerateRequest:
    input_ids: list[int] | None
    text: str | None
    sampling: SamplingParams
    stream: bool = False
    max_tokens_set: bool = False


def parse_json(raw: bytes) -> Any:
    """Decode a request body; 400 unless it is valid UTF-8 JSON holding an object."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError, TypeError) as e:
        raise bad_request(f"Request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object.")
    return body


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


# SamplingParams field -> (OpenAI name, reader); stop_token_ids, max and logprobs are special.
_SAMPLING_FIELDS: dict[str, tuple[str, Callable[[Any, str], Any]]] = {
    "temperature": ("temperature", read_real),
    "top_p": ("top_p", read_real),
    "top_k": ("top_k", read_int),
    "min_p": ("min_p", read_real),
    "seed": ("seed", read_int),
    "frequency_penalty": ("frequency_penalty", read_real),
    "presence_penalty": ("presence_penalty", read_real),
    "repetition_penalty": ("repetition_penalty", read_real),
    "stop": ("stop", read_stop),
    "ignore_eos": ("ignore_eos", read_bool),
    "min_new_tokens": ("min_tokens", read_int),
    "skip_special_tokens": ("skip_special_tokens", read_bool),
}


def _sampling(
    body: dict, extra: dict, names: dict[str, str], limits: RequestLimits, prefix: str = ""
) -> SamplingParams:
    """SamplingParams from `body`; `extra` holds fields already read, `names` their JSON names."""
    values = dict(extra)
    for fld, (key, read) in _SAMPLING_FIELDS.items():
        key = names.get(fld, key)
        v = body.get(key)
        if v is not None:
            values[fld] = read(v, prefix + key)
    ids = body.get("stop_token_ids")
    if ids is not None:
        values["stop_token_ids"] = read_token_ids(ids, prefix + "stop_token_ids", limits)
    bias = body.get("logit_bias")
    if bias is not None:
        values["logit_bias"] = read_logit_bias(bias, prefix + "logit_bias")
    params = SamplingParams(**values)
    try:
        params.validate(limits.vocab_size)
    except ValueError as e:
        fld, _, what = str(e).partition(": ")
        param = prefix + names.get(fld, _SAMPLING_FIELDS.get(fld, (fld,))[0])
        raise bad_request(f"{param}: {what}", param) from None
    return params


def _priority(body: dict) -> int:
    """The request's `priority` (default 0): an integer in [PRIORITY_MIN, PRIORITY_MAX], else a 400 naming it."""
    v = optional(body, "priority", read_int, 0)
    if not PRIORITY_MIN <= v <= PRIORITY_MAX:
        raise bad_request(f"priority: must be between {PRIORITY_MIN} and {PRIORITY_MAX}, got {show(v)}", "priority")
    return v


def _max_tokens(
    body: dict, key: str, default: int, limits: RequestLimits, prefix: str = "", least: int = 1
) -> tuple[int, bool]:
    """(max_new_tokens, whether the client set it); a default is capped at the context. `least` 0 (echo): 0 runs as 1
    and the token is dropped (`server/endpoints/completions.py`)."""
    v = body.get(key)
    if v is None:
        return min(default, limits.max_context_len), False
    param = prefix + key
    if (n := read_int(v, param)) < least:
        raise bad_request(f"{param}: must be at least {least}, got {show(n)}", param)
    limits.check_max_tokens(n := max(n, 1), param)
    return n, True


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object.")
    return body


def _model(body: dict, served_model: str, adapters: Collection[str] = ()) -> str:
    """The model a request names: the served model, or one of its LoRA `adapters`; 404 naming `model` otherwise."""
    model = optional(body, "model", read_text, served_model)
    if model != served_model and model not in adapters:
        raise model_not_found(model)
    return model


def _stream(body: dict) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage)."""
    stream = optional(body, "stream", read_bool, False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise bad_request("stream_options: must be an object", "stream_options")
    if not stream:
        raise bad_request("stream_options: only allowed when stream is true", "stream_options")
    return stream, optional(options, "include_usage", read_bool, False, "stream_options.")


def _n(body: dict) -> int:
    n = optional(body, "n", read_int, 1)
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n: must be between 1 and {MAX_N}, got {show(n)}", "n")
    return n


def split_prompts(v: Any) -> list[Any]:
    """OpenAI's four forms of `prompt` as a list of prompts, unread: a string or a token list is one prompt; a list
    of strings or of token lists (a list whose first element is either) is a batch, as long as it is."""
    return v if isinstance(v, list) and v and isinstance(v[0], (str, list)) else [v]


def check_batch(count: int, n: int) -> None:
    """A batch of `count` prompts answers count * n choices: at most MAX_BATCH_CHOICES."""
    if count * n > MAX_BATCH_CHOICES:
        raise bad_request(
            f"prompt: a batch of {count} prompts with n = {n} asks for {count * n} choices; at most "
            f"{MAX_BATCH_CHOICES} per request",
            "prompt",
        )


def _prompt(v: Any, param: str, limits: RequestLimits) -> str | list[int]:
    """One prompt: a non-empty string or token list."""
    if isinstance(v, str):
        if not v:
            raise bad_request(f"{param}: must not be empty", param)
        return read_text(v, param)
    if not isinstance(v, list) or not v:
        raise bad_request(f"{param}: must be a non-empty string or list of token ids", param)
    return list(read_token_list(v, param, limits))


def _prompts(body: dict, limits: RequestLimits) -> list[tuple[str | list[int], str]]:
    """Each prompt and the name its errors go by: `prompt`, or `prompt[i]` in a batch (bounded before it is read)."""
    batch = split_prompts(body["prompt"])
    if len(batch) == 1:
        return [(_prompt(batch[0], "prompt", limits), "prompt")]
    check_batch(len(batch), _n(body))
    return [(_prompt(p, f"prompt[{i}]", limits), f"prompt[{i}]") for i, p in enumerate(batch)]


def parse_completions(
    body: Any, served_model: str, limits: RequestLimits, adapters: Collection[str] = ()
) -> list[CompletionRequest]:
    """POST /v1/completions: one request per prompt, in order (a batch's prompt i answers choices i * n to
    i * n + n - 1). Token prompts are checked against the limits here, text ones once tokenised. A `model` among
    `adapters` runs under that LoRA adapter (`SamplingParams.lora`)."""
    body = _object(body)
    model = _model(body, served_model, adapters)
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("prompt: is required", "prompt")
    prompts = _prompts(body, limits)
    echo = optional(body, "echo", read_bool, False)
    stream, usage = _stream(body)
    n = _n(body)
    user = optional(body, "user", read_text, None)
    max_new, explicit = _max_tokens(body, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS, limits, least=int(not echo))
    logprobs = optional(body, "logprobs", read_int, None)
    extra = {
        "max_new_tokens": max_new,
        "logprobs": logprobs,
        "grammar": parse_openai_grammar(body),
        "prompt_logprobs": echo and logprobs is not None,
        "lora": model if model != served_model else "",
        "priority": _priority(body),
    }
    sampling = _sampling(body, extra, {"max_new_tokens": "max_tokens"}, limits)
    echo_only = echo and body.get("max_tokens") == 0
    shared = CompletionRequest(model, "", sampling, stream, usage, echo, n, user, explicit, echo_only)
    requests = []
    for p, param in prompts:
        fitted = limits.admit(p, sampling, explicit, prompt_param=param) if isinstance(p, list) else sampling
        requests.append(replace(shared, prompt=p, sampling=fitted, param=param))
    return requests


def _content(v: Any, role: str, param: str) -> str:
    if v is None and role == "assistant":
        return ""
    if isinstance(v, str):
        return read_text(v, param)
    if not isinstance(v, list):
        raise bad_request(f"{param}: must be a string or a list of text parts", param)
    texts = []
    for part in v:
        if not isinstance(part, dict) or part.get("type") != "text":
            raise bad_request(f'{param}: only parts of type "text" are supported', param)
        texts.append(read_text(part.get("text"), param))
    return "".join(texts)


def _messages(v: Any) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise bad_request("messages: must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(v):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{param}: must be an object", param)
        role = m.get("role")
        if role not in CHAT_ROLES:
            roles = ", ".join(CHAT_ROLES)
            raise bad_request(f"{param}.role: must be one of {roles}", f"{param}.role")
        msg: dict = {"role": role, "content": _content(m.get("content"), role, f"{param}.content")}
        if m.get("name") is not None:
            msg["name"] = read_text(m["name"], f"{param}.name")
        calls = message_tool_calls(m, param) if role == "assistant" else None
        if calls:
            msg["tool_calls"] = calls
        if role == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = read_text(m["tool_call_id"], f"{param}.tool_call_id")
        out.append(msg)
    return out


def _chat_logprobs(body: dict) -> int | None:
    want = optional(body, "logprobs", read_bool, False)
    top = optional(body, "top_logprobs", read_int, None)
    if top is not None and not want:
        raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")
    return (top or 0) if want else None


def parse_chat(body: Any, served_model: str, limits: RequestLimits, adapters: Collection[str] = ()) -> ChatRequest:
    """POST /v1/chat/completions. max_completion_tokens wins over the older max_tokens; a `model` among `adapters`
    runs under that LoRA adapter."""
    body = _object(body)
    model = _model(body, served_model, adapters)
    tools = parse_tool_use(body)
    grammar = parse_openai_grammar(body)
    messages = _messages(body.get("messages"))
    stream, usage = _stream(body)
    n = _n(body)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_new, explicit = _max_tokens(body, key, DEFAULT_CHAT_MAX_TOKENS, limits)
    extra = {"max_new_tokens": max_new, "logprobs": _chat_logprobs(body), "grammar": grammar}
    extra["lora"] = model if model != served_model else ""
    extra["priority"] = _priority(body)
    names = {"max_new_tokens": key, "logprobs": "top_logprobs"}
    sampling = _sampling(body, extra, names, limits)
    add_gen = optional(body, "add_generation_prompt", read_bool, True)
    user = optional(body, "user", read_text, None)
    return ChatRequest(model, messages, sampling, stream, usage, n, add_gen, user, explicit, tools)


def parse_generate(body: Any, limits: RequestLimits) -> GenerateRequest:
    """POST /generate: {"input_ids": [...]} or {"text": "..."}, "sampling_params", "stream"."""
    body = _object(body)
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise bad_request("Exactly one of input_ids and text must be given.", "input_ids")
    if ids is not None and not ids:
        raise bad_request("input_ids: must not be empty", "input_ids")
    input_ids = None if ids is None else list(read_token_list(ids, "input_ids", limits))
    if text is not None and not read_text(text, "text"):
        raise bad_request("text: must not be empty", "text")
    raw = body.get("sampling_params")
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise bad_request("sampling_params: must be an object", "sampling_params")
    prefix = "sampling_params."
    max_new, explicit = _max_tokens(raw, "max_new_tokens", DEFAULT_COMPLETION_MAX_TOKENS, limits, prefix)
    extra = {
        "max_new_tokens": max_new,
        "logprobs": optional(raw, "logprobs", read_int, None, prefix),
        "grammar": parse_native_grammar(raw, prefix),
        "priority": _priority(body),
    }
    names = {f: f for f in _SAMPLING_FIELDS}
    sampling = _sampling(raw, extra, names, limits, prefix)
    if input_ids is not None:
        sampling = limits.admit(input_ids, sampling, explicit, prefix + "max_new_tokens", "input_ids")
    return GenerateRequest(input_ids, text, sampling, optional(body, "stream", read_bool, False), explicit)
