"""A forced tool call on a model whose chat template cannot offer tools.

`tool_choice: "required"` or a named function needs no template support: the answer is constrained to one
call whose arguments follow the function's schema (`tool_calls.forcing_grammar`), written as a bare JSON
object `{"name": ..., "parameters": {...}}` (the Llama 3 format, which needs no special tokens). What the
template cannot render goes into the prompt as text, as vLLM does: the tools and the call format in a system
message (added to the first one, if any), an earlier turn's calls as that JSON in the assistant's content.
"""

from __future__ import annotations

import json

PREAMBLE = (
    "You can call these functions. To call one, answer with only a JSON object "
    '{"name": <function name>, "parameters": <its arguments>}.\n'
)


def tools_text(tools: list[dict]) -> str:
    """The offered tools (OpenAI's shape) as the system text that introduces them."""
    lines = [json.dumps(t["function"], ensure_ascii=False) for t in tools]
    return PREAMBLE + "\n".join(lines)


def messages_with_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The chat with the tools in its system message and earlier calls written out as text."""
    out = [_as_text(m) for m in messages]
    text = tools_text(tools)
    if out and out[0]["role"] == "system":
        return [{**out[0], "content": f"{out[0]['content']}\n\n{text}"}, *out[1:]]
    return [{"role": "system", "content": text}, *out]


def _as_text(m: dict) -> dict:
    calls = m.get("tool_calls")
    if not calls:
        return m
    written = "; ".join(
        json.dumps({"name": c["function"]["name"], "parameters": c["function"]["arguments"]}, ensure_ascii=False)
        for c in calls
    )
    content = f"{m['content']}\n{written}" if m.get("content") else written
    return {k: v for k, v in m.items() if k != "tool_calls"} | {"content": content}
