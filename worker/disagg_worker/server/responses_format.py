"""Responses API bodies and stream events, built from one choice's text, calls and counts. Pure.

A response's `output` holds a `message` item (the text, one `output_text` part) when the answer has text,
then one `function_call` item per call. Streamed, the events come in OpenAI's order, each with its
`sequence_number`: `response.created`, `response.in_progress`, then per item `response.output_item.added`,
(`response.content_part.added`, `response.output_text.delta`..., `response.output_text.done`,
`response.content_part.done`) or (`response.function_call_arguments.delta`,
`response.function_call_arguments.done`), `response.output_item.done`, and last `response.completed` (or
`response.incomplete` when `max_output_tokens` cut the answer) with the whole response.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

ECHOED = ("instructions", "max_output_tokens", "previous_response_id", "metadata", "user")


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ResponseHead:
    """What every form of one response repeats: its id, model, time and the request's settings."""

    id: str
    model: str
    request: dict
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, status: str, output: list[dict], usage: dict | None, incomplete: str | None = None) -> dict:
        r = self.request
        body = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": r.get("parallel_tool_calls", True),
            "temperature": r.get("temperature", 1.0),
            "top_p": r.get("top_p", 1.0),
            "tool_choice": r.get("tool_choice", "auto"),
            "tools": r.get("tools") or [],
            "text": r.get("text") or {"format": {"type": "text"}},
            "truncation": "disabled",
            "store": r.get("store", True),
            "usage": usage,
        }
        body.update({k: r.get(k) for k in ECHOED})
        body["metadata"] = body["metadata"] or {}
        return body


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def call_item(call: dict, status: str = "completed", arguments: str | None = None) -> dict:
    """A chat tool call (`tool_calls.py`'s shape) as a `function_call` item; its call id is the chat call's."""
    fn = call["function"]
    args = fn["arguments"] if arguments is None else arguments
    item_id = "fc_" + call["id"].removeprefix("call_")
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": args,
        "status": status,
    }


def incomplete_reason(finish_reason: str | None) -> str | None:
    return "max_output_tokens" if finish_reason == "length" else None


def whole_output(text: str | None, calls: list[dict], status: str = "completed") -> list[dict]:
    items = [message_item(new_item_id("msg"), text, status)] if text else []
    return items + [call_item(c) for c in calls]


class ResponseEvents:
    """The SSE events of one streamed response; `text` as it comes, `finish` with the calls and counts."""

    def __init__(self, head: ResponseHead):
        self.head = head
        self.seq = 0
        self.output: list[dict] = []
        self.message: dict | None = None  # the message item being streamed
        self.text = ""

    def event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

    def start(self) -> bytes:
        r = self.head.response("in_progress", [], None)
        return self.event("response.created", response=r) + self.event("response.in_progress", response=r)

    def delta(self, text: str) -> bytes:
        if not text:
            return b""
        out = b""
        if self.message is None:
            self.message = message_item(new_item_id("msg"), "", "in_progress")
            self.message["content"] = []
            out += self.event("response.output_item.added", output_index=len(self.output), item=self.message)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self.event("response.content_part.added", **self._at(), part=part)
        self.text += text
        return out + self.event("response.output_text.delta", **self._at(), delta=text, logprobs=[])

    def _at(self) -> dict:
        assert self.message is not None
        return {"item_id": self.message["id"], "output_index": len(self.output), "content_index": 0}

    def _end_message(self, status: str) -> bytes:
        if self.message is None:
            return b""
        at, text = self._at(), self.text
        item = message_item(self.message["id"], text, status)
        out = self.event("response.output_text.done", **at, text=text, logprobs=[])
        out += self.event("response.content_part.done", **at, part=item["content"][0])
        out += self.event("response.output_item.done", output_index=at["output_index"], item=item)
        self.output.append(item)
        self.message = None
        return out

    def finish(self, calls: list[dict], finish_reason: str | None, counts: dict) -> tuple[bytes, dict]:
        """The closing events and the whole response (for the store)."""
        incomplete = incomplete_reason(finish_reason)
        status = "incomplete" if incomplete else "completed"
        out = self._end_message(status)
        for call in calls:
            index, item = len(self.output), call_item(call)
            out += self.event("response.output_item.added", output_index=index, item=call_item(call, "in_progress", ""))
            at = {"item_id": item["id"], "output_index": index}
            out += self.event("response.function_call_arguments.delta", **at, delta=item["arguments"])
            out += self.event(
                "response.function_call_arguments.done", **at, arguments=item["arguments"], name=item["name"]
            )
            out += self.event("response.output_item.done", output_index=index, item=item)
            self.output.append(item)
        response = self.head.response(status, self.output, counts, incomplete)
        return out + self.event(f"response.{status}", response=response), response

    def error(self, body: dict) -> bytes:
        """An error in the middle of the stream, in the Responses stream's shape."""
        e = body.get("error", {})
        return self.event("error", code=e.get("code"), message=e.get("message"), param=e.get("param"))
