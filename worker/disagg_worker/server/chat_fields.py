"""Chat request fields beyond messages and sampling: tool calling (not implemented: refused, never
ignored). Used by `protocol.parse_chat`."""

from __future__ import annotations

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
