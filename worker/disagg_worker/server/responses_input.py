"""A Responses API request (`POST /v1/responses`) read as the chat request it runs as.

`input` (a string, or items: messages with text content, `function_call` and `function_call_output`), an
earlier turn's conversation first when it continues one (`previous_response_id`, `response_store.py`),
`instructions` as the system message; function `tools` (flat, as the Responses API has them) and
`tool_choice`; `text.format` (text, json_object, json_schema: constrained); `max_output_tokens`,
`temperature`, `top_p`. The chat body is parsed by chat's own parser (`protocol.parse_chat`); an error there
names the Responses field. Items of other kinds (reasoning is dropped; images, files, built-in tools) are a
400 naming them.
"""

from __future__ import annotations

import json
from typing import Any

from disagg_worker.request.errors import APIError, bad_request
from disagg_worker.request.limits import RequestLimits
from disagg_worker.server.protocol import ChatRequest, parse_chat

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")
# Fields passed to chat as they are (same name, same meaning).
SAME = ("model", "temperature", "top_p", "top_k", "seed", "stream", "parallel_tool_calls", "user", "stop")
# Chat's names of the fields whose Responses names differ, for its errors.
RENAMED = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format", "tools": "tools"}


def input_items(body: dict) -> list[dict]:
    """The request's own `input` as a list of items (a string is one user message)."""
    raw = body.get("input")
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad_request("input: must be a string or a non-empty list of items", "input")
    return raw


def to_chat_body(body: dict, items: list[dict]) -> dict:
    """The chat completions body this Responses request runs as; `items` is the whole conversation."""
    messages = _messages(items)
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("instructions: must be a string", "instructions")
        messages.insert(0, {"role": "system", "content": instructions})
    chat: dict[str, Any] = {k: body[k] for k in SAME if body.get(k) is not None}
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools") not in (None, []):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _format(body.get("text"))
    if fmt is not None and not _forced(chat):  # a forced call writes no text to format
        chat["response_format"] = fmt
    return chat


def parse_responses(body: dict, items: list[dict], model: str, limits: RequestLimits) -> ChatRequest:
    try:
        return parse_chat(to_chat_body(body, items), model, limits)
    except APIError as e:
        raise renamed(e) from None


def renamed(e: APIError) -> APIError:
    """Chat's error with the field named as the Responses API names it."""
    if e.param is None:
        return e
    head, dot, rest = e.param.partition(".")
    base = head.split("[")[0]
    if base not in RENAMED:
        return e
    name = RENAMED[base] + head[len(base) :] + dot + rest
    name = name.replace("text.format.json_schema.", "text.format.").replace(".function.", ".")
    return APIError(e.status, e.message.replace(e.param, name, 1), e.type, name, e.code, e.retry_after)


def _messages(items: list[dict]) -> list[dict]:
    out: list[dict] = []
    for i, item in enumerate(items):
        p = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{p}: must be an object", p)
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise bad_request(f"{p}.role: must be one of {', '.join(ROLES)}", f"{p}.role")
            out.append({"role": role, "content": _text(item.get("content"), f"{p}.content")})
        elif kind == "function_call":
            fn = {"name": _str(item, "name", p), "arguments": _str(item, "arguments", p)}
            call = {"id": _str(item, "call_id", p), "type": "function", "function": fn}
            if not (out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]):
                out.append({"role": "assistant", "content": "", "tool_calls": []})
            out[-1]["tool_calls"].append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, f"{p}.output")
            out.append({"role": "tool", "tool_call_id": _str(item, "call_id", p), "content": content})
        elif kind != "reasoning":  # a reasoning item carries nothing this server needs
            shown = json.dumps(kind)[:40] if isinstance(kind, str) else "a non-string"
            raise bad_request(f"{p}.type: {shown} is not supported", f"{p}.type")
    return out


def _str(item: dict, key: str, p: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise bad_request(f"{p}.{key}: must be a string", f"{p}.{key}")
    return v


def _text(v: Any, p: str) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise bad_request(f"{p}: must be a string or a list of text parts", p)
    texts = []
    for k, part in enumerate(v):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{p}[{k}]: only text parts (input_text, output_text) are supported", f"{p}[{k}]")
        texts.append(part["text"])
    return "".join(texts)


def _tools(raw: Any) -> list[dict]:
    if not isinstance(raw, list):
        raise bad_request("tools: must be a list of functions", "tools")
    out = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise bad_request(f'tools[{i}].type: only "function" tools are supported', f"tools[{i}].type")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(v: Any) -> Any:
    if isinstance(v, dict) and v.get("type") == "function" and "function" not in v:
        return {"type": "function", "function": {"name": v.get("name")}}
    return v


def _forced(chat: dict) -> bool:
    return bool(chat.get("tools")) and chat.get("tool_choice") not in (None, "auto", "none")


def _format(text: Any) -> dict | None:
    """`text.format` as chat's response_format."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("text: must be an object", "text")
    fmt = text.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    return fmt
