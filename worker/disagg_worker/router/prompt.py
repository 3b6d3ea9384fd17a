"""A request's prompt as the workers will tokenise it, for the router's cache-aware choice (`--tokenizer`).

The router parses the body with the workers' own parsers (`server/protocol.py`) and renders a chat with the
model's template (offered tools included), then names the prompt's whole pages (`mem/kv_events.page_hashes`).
A body the router cannot read this way gets no names: it is routed by load, and the worker answers it (a bad
request is the worker's to refuse, with its own message). Routing never changes an answer, only where the
prompt is computed.
"""

from __future__ import annotations

from typing import Any

from disagg_worker.mem.kv_events import page_hashes
from disagg_worker.model.tokenizer import Tokenizer
from disagg_worker.request.limits import RequestLimits
from disagg_worker.router.kv_index import KVIndex
from disagg_worker.router.policies.prefix import Prompt
from disagg_worker.server.protocol import parse_chat, parse_completions, parse_generate
from disagg_worker.server.tool_calls import ChatTools

# The router checks no limits (the workers do): any context length passes here.
_NO_LIMITS = RequestLimits(max_context_len=1 << 40)


class PromptTokens:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def load(cls, path: str) -> PromptTokens:
        return cls(Tokenizer.from_path(path))

    def ids(self, path: str, body: Any) -> list[int] | None:
        """The prompt's token ids; None for a body the router does not read (routed by load)."""
        try:
            return self._ids(path, body)
        except Exception:  # noqa: BLE001 - any body the router cannot read (a template error too) goes by load
            return None

    def _ids(self, path: str, body: Any) -> list[int] | None:
        tok = self.tokenizer
        model = str(body.get("model") or "") if isinstance(body, dict) else ""
        if path == "/generate":
            gen = parse_generate(body, _NO_LIMITS)
            return gen.input_ids if gen.input_ids is not None else tok.encode(gen.text or "")
        if path == "/v1/completions":
            requests = parse_completions(body, model, _NO_LIMITS)
            if len(requests) != 1:  # a batch: the router scores each prompt once it has split them
                return None
            prompt = requests[0].prompt
            return prompt if isinstance(prompt, list) else tok.encode(prompt)
        if path == "/v1/chat/completions":
            chat = parse_chat(body, model, _NO_LIMITS)
            tools = ChatTools.of(chat.tools, tok.chat_template_source)
            messages, offered = (tools.messages(chat.messages), tools.offered()) if tools else (chat.messages, None)
            text = tok.apply_chat_template(messages, chat.add_generation_prompt, offered)
            return tok.encode(text, add_special_tokens=False)
        return None


def prompt_of(prompts: PromptTokens | None, index: KVIndex, kv_key: bytes, path: str, body: Any) -> Prompt | None:
    """The prompt as the cache-aware policy scores it, its pages named with the workers' key: None without a
    tokenizer, before any worker's page size is known, or for a body not read this way (then routed by load)."""
    ref = index.reference()
    if prompts is None or ref is None:
        return None
    ids = prompts.ids(path, body)
    return Prompt(len(ids), page_hashes(ids, ref[0], key=kv_key), ref[0]) if ids else None
