"""Chat request fields beyond messages and sampling: `response_format` (structured output, enforced by
`engine/grammar.py`) and tool calling (not implemented: refused, never ignored). Used by `protocol.parse_chat`."""

from __future__ import annotations

import json

from disagg_worker.server.errors import bad_request


def no_tool_calling(body: dict) -> None:
    """Tools are not parsed or offered to the model: a request that relies on them is a 400, never an
    answer that silently ignored them. No tools (absent, null or []) with tool_choice "none" or "auto" is fine."""
    for key in ("tools", "functions"):
        if body.get(key) not in (None, []):
            raise bad_request(
                f"{key}: tool calling is not supported by this server; send the request without {key}", key
            )
    for key in ("tool_choice", "function_call"):
        if body.get(key) not in (None, "none", "auto"):
            raise bad_request(f'{key}: tool calling is not supported by this server; only "none" is accepted', key)
    messages = body.get("messages")
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        if isinstance(m, dict) and m.get("tool_calls") not in (None, []):
            param = f"messages[{i}].tool_calls"
            raise bad_request(f"{param}: tool calling is not supported by this server", param)


def parse_response_format(body: dict) -> str | None:
    """OpenAI's response_format as `SamplingParams.response_format` (`engine/grammar.py`): None for text,
    else a canonical JSON string; the schema itself is compiled (and refused) by the scheduler."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "json_object"})
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            param = "response_format.json_schema.schema"
            raise bad_request(f"{param}: must be a JSON schema (an object)", param)
        return json.dumps({"type": "json_schema", "schema": schema}, sort_keys=True)
    shown = json.dumps(kind) if isinstance(kind, (str, int, float, bool)) else type(kind).__name__
    what = f"type {shown[:40]}" if kind is not None else "a value without a type"
    raise bad_request(
        f"response_format: {what} is not supported; use text, json_object or json_schema", "response_format"
    )
