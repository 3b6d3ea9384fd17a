"""Tool calling in chat: the request's `tools` and `tool_choice`, the template's call format, the
grammar that forces a call, and the calls parsed back out of the generated text.

Two call formats are recognised from the chat template's source:
- "hermes" (Qwen2.5, Qwen3, Hermes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one
  block per call, after optional text;
- "llama3_json" (Llama 3.1/3.2): the whole answer is `{"name": ..., "parameters": {...}}` (optionally after
  `<|python_tag|>`), several separated by `;`.
A template that never mentions `tools` cannot offer them: a request that lets the model choose ("auto")
is a 400 there, as is one whose template uses a format not listed here. A forced call needs no template
support: it is written in the Llama 3 format, the tools put into the prompt when the template cannot
render them (`tool_prompt.py`).

`tool_choice`: "none" offers no tools and parses nothing; "auto" offers them and parses what the
model wrote; "required" and a named function also constrain the output (`grammar`, compiled by
`engine/grammar.py`) to exactly one call in the template's format, of a listed tool (or the named one),
whose arguments follow the tool's parameters schema. Pure functions and one streaming filter.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

from disagg_worker.request.errors import bad_request
from disagg_worker.server.tool_prompt import messages_with_tools

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
HERMES, LLAMA3 = "hermes", "llama3_json"
_HERMES_OPEN, _HERMES_CLOSE, _PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"
_ARGUMENTS = {HERMES: "arguments", LLAMA3: "parameters"}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict


@dataclass(frozen=True)
class ToolUse:
    """What a chat request asks of tools; `choice` is "auto", "required" or a tool's name."""

    tools: tuple[Tool, ...]
    choice: str
    parallel: bool = True

    def template_tools(self) -> list[dict]:
        """The tools as chat templates read them (OpenAI's shape)."""
        return [
            {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
            for t in self.tools
        ]

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)


def parse_tool_use(body: dict) -> ToolUse | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat body; None when no tool is offered."""
    for key in ("functions", "function_call"):
        if body.get(key) is not None:
            raise bad_request(f"{key}: the legacy function-calling fields are not supported; use tools", key)
    raw = body.get("tools")
    tools = _tools(raw) if raw not in (None, []) else ()
    choice = _choice(body.get("tool_choice"), {t.name for t in tools})
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls: must be a boolean", "parallel_tool_calls")
    if not tools or choice == "none":
        return None
    return ToolUse(tools, choice, parallel)


def _tools(raw: Any) -> tuple[Tool, ...]:
    if not isinstance(raw, list):
        raise bad_request("tools: must be a list of functions", "tools")
    out = []
    for i, t in enumerate(raw):
        p = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise bad_request(f'{p}: must be {{"type": "function", "function": {{...}}}}', p)
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise bad_request(f"{p}.function.name: must match {NAME.pattern}", f"{p}.function.name")
        desc = fn.get("description") or ""
        if not isinstance(desc, str):
            raise bad_request(f"{p}.function.description: must be a string", f"{p}.function.description")
        params = fn.get("parameters")
        params = {"type": "object", "properties": {}} if params is None else params
        if not isinstance(params, dict):
            raise bad_request(f"{p}.function.parameters: must be a JSON schema object", f"{p}.function.parameters")
        out.append(Tool(name, desc, params))
    if len({t.name for t in out}) != len(out):
        raise bad_request("tools: function names must be unique", "tools")
    return tuple(out)


def _choice(v: Any, names: set[str]) -> str:
    if v is None:
        return "auto"
    if v in ("none", "auto", "required"):
        if v == "required" and not names:
            raise bad_request('tool_choice: "required" needs tools', "tool_choice")
        return v
    fn = v.get("function") if isinstance(v, dict) and v.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_request(
            'tool_choice: must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in names:
        raise bad_request(f"tool_choice: names {name[:64]!r}, which is not in tools", "tool_choice")
    return name


def message_tool_calls(m: dict, param: str) -> list[dict] | None:
    """An assistant message's `tool_calls` as chat templates read them: OpenAI sends each call's
    arguments as a JSON string, templates (Qwen's, Llama's) expect the object."""
    raw = m.get("tool_calls")
    if raw in (None, []):
        return None
    if not isinstance(raw, list):
        raise bad_request(f"{param}.tool_calls: must be a list", f"{param}.tool_calls")
    out = []
    for i, c in enumerate(raw):
        p = f"{param}.tool_calls[{i}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f'{p}: must be {{"type": "function", "function": {{"name", "arguments"}}}}', p)
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            raise bad_request(f"{p}.function.arguments: is not valid JSON", f"{p}.function.arguments") from None
        call = {"name": fn["name"], "arguments": args}
        out.append({"id": str(c.get("id", "")), "type": "function", "function": call})
    return out


def template_style(source: str | None) -> str | None:
    """The call format a chat template writes: HERMES, LLAMA3, "unknown", or None without tool support."""
    if not source or "tools" not in source:
        return None
    if _HERMES_OPEN in source:
        return HERMES
    if _PYTHON_TAG in source or ('"parameters"' in source and "<|eot_id|>" in source):
        return LLAMA3
    return "unknown"


def check_style(style: str | None) -> str:
    if style is None:
        raise bad_request("tools: this model's chat template does not support tool calling", "tools")
    if style == "unknown":
        raise bad_request("tools: this model's chat template writes tool calls in a format not supported", "tools")
    return style


def forcing_grammar(use: ToolUse, style: str) -> str | None:
    """The grammar spec (`SamplingParams.grammar`) of "required" or a named choice; None for "auto"."""
    if use.choice == "auto":
        return None
    tools = [t for t in use.tools if use.choice in ("required", t.name)]
    begin, end = (_HERMES_OPEN + "\n", "\n" + _HERMES_CLOSE) if style == HERMES else ("", "")
    spec = {
        "type": "tool_calls",
        "begin": begin,
        "end": end,
        "arguments_key": _ARGUMENTS[style],
        "tools": [{"name": t.name, "parameters": t.parameters} for t in tools],
    }
    return json.dumps(spec, sort_keys=True)


# ---- the answer ----------------------------------------------------------------------------------


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(24))


def parse_calls(text: str, style: str, names: frozenset[str]) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a generated answer. Anything that is not a well-formed call of a listed
    tool stays content, whole: no call is made up from a malformed one."""
    found = _hermes(text) if style == HERMES else _llama3(text)
    if found is None:
        return text, []
    content, raw_calls = found
    calls = []
    for obj in raw_calls:
        args = obj.get(_ARGUMENTS[style], obj.get("arguments")) if isinstance(obj, dict) else None
        if not isinstance(args, dict) or obj.get("name") not in names:
            return text, []
        arguments = json.dumps(args, ensure_ascii=False)
        calls.append(
            {"id": new_call_id(), "type": "function", "function": {"name": obj["name"], "arguments": arguments}}
        )
    return (content or None), calls


def _hermes(text: str) -> tuple[str | None, list[Any]] | None:
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return None
    calls, rest = [], text[start:]
    while rest.startswith(_HERMES_OPEN):
        end = rest.find(_HERMES_CLOSE)
        body = rest[len(_HERMES_OPEN) : end if end >= 0 else len(rest)]
        try:
            calls.append(json.loads(body))
        except ValueError:
            return None
        rest = rest[end + len(_HERMES_CLOSE) :].lstrip() if end >= 0 else ""
    if rest.strip():  # text after the calls: not an answer made of calls
        return None
    return text[:start].rstrip(), calls


def _llama3(text: str) -> tuple[str | None, list[Any]] | None:
    rest = text.strip()
    rest = rest.removeprefix(_PYTHON_TAG).lstrip()
    if not rest.startswith("{"):
        return None
    calls, decoder = [], json.JSONDecoder()
    while rest:
        try:
            obj, end = decoder.raw_decode(rest)
        except ValueError:
            return None
        calls.append(obj)
        rest = rest[end:].strip().removeprefix(";").strip()
    return "", calls


@dataclass
class ToolStream:
    """One streamed choice's text split into content to send now and a call held back until the end.

    Hermes: content flows until text that could open a call (`<tool_call>`, or a prefix of it at the end);
    from there everything is held. Llama 3: the answer is a call when it starts with `{` or the python
    tag, so nothing is sent until its first characters decide."""

    style: str
    names: frozenset[str]
    parallel: bool = True
    held: str = ""
    sent: str = ""
    holding: bool = False  # a call may have begun: hold everything to the end
    plain: bool = False  # Llama 3: the answer is text, not a call
    found: list[dict] = field(default_factory=list)  # the calls, once finished

    def push(self, text: str) -> str:
        self.held += text
        if self.holding:
            return ""
        if self.plain:
            return self._send(self.held)
        if self.style == LLAMA3:
            head = self.held.lstrip()
            if head.startswith("{") or head.startswith(_PYTHON_TAG):
                self.holding = True
            elif head and not _PYTHON_TAG.startswith(head):
                self.plain = True
                return self._send(self.held)
            return ""
        # Blanks before a call are not content (as `parse_calls` has it): held until text follows them.
        at = self.held.find(_HERMES_OPEN)
        if at >= 0:
            self.holding = True
            return self._send(self.held[:at].rstrip())
        keep = next(
            (
                n
                for n in range(min(len(_HERMES_OPEN) - 1, len(self.held)), 0, -1)
                if _HERMES_OPEN.startswith(self.held[-n:])
            ),
            0,
        )
        return self._send(self.held[: len(self.held) - keep].rstrip())

    def _send(self, text: str) -> str:
        self.held = self.held[len(text) :]
        self.sent += text
        return text

    def finish(self, finish_reason: str | None = "stop") -> str:
        """At the end of the choice: the text still to send as content; the calls go to `found`. What was
        held is a call when it parses as one and the answer ended by itself (not cut by max_tokens);
        otherwise it goes out as content."""
        found: list[dict] = []
        if finish_reason == "stop":
            _, found = parse_calls(self.sent + self.held, self.style, self.names)
        self.found = found if self.parallel else found[:1]
        rest, self.held = ("" if self.found else self.held), ""
        return rest


@dataclass(frozen=True)
class ChatTools:
    """Tools offered by one chat request to a template that writes calls in `style`; `in_prompt`: the
    template cannot render them, so they go into the prompt as text (a forced call only)."""

    use: ToolUse
    style: str
    in_prompt: bool = False

    @classmethod
    def of(cls, use: ToolUse | None, template_source: str | None) -> ChatTools | None:
        if use is None:
            return None
        style = template_style(template_source)
        if use.choice != "auto" and style in (None, "unknown"):  # constrained: no template support needed
            return cls(use, LLAMA3, in_prompt=style is None)
        return cls(use, check_style(style))

    def offered(self) -> list[dict] | None:
        """The tools the template renders (None when they are in the prompt as text)."""
        return None if self.in_prompt else self.use.template_tools()

    def messages(self, messages: list[dict]) -> list[dict]:
        """The chat as the template gets it: with the tools written in, when it cannot render them."""
        return messages_with_tools(messages, self.use.template_tools()) if self.in_prompt else messages

    def grammar(self, other: str | None) -> str | None:
        """The request's grammar: the forcing one for "required" or a named tool, else `other`."""
        forcing = forcing_grammar(self.use, self.style)
        if forcing is not None and other is not None:
            raise bad_request("tool_choice: a forced tool call cannot be combined with response_format", "tool_choice")
        return forcing or other

    def answer(self, choice: dict) -> dict:
        """A whole chat choice with its calls parsed out of the content (the first only, when the request
        turned parallel calls off), if the answer ended by itself."""
        if choice["finish_reason"] != "stop":  # cut by max_tokens (or aborted): what it wrote stays text
            return choice
        content, calls = parse_calls(choice["message"]["content"], self.style, self.use.names)
        calls = calls if self.use.parallel else calls[:1]
        if not calls:
            return choice
        message = {"role": "assistant", "content": content, "tool_calls": calls}
        return {**choice, "message": message, "finish_reason": "tool_calls"}

    def stream(self) -> ToolStream:
        return ToolStream(self.style, self.use.names, self.use.parallel)


def call_deltas(calls: list[dict]) -> list[dict]:
    """Streamed `delta.tool_calls` entries: each call whole, with its index."""
    return [{"index": k, **c} for k, c in enumerate(calls)]
