"""`POST /tokenize` and `POST /detokenize`, with vLLM's request and response shapes.

/tokenize takes a `prompt` (special tokens added unless `add_special_tokens` is false) or chat `messages`
(rendered with the chat template, offered `tools` included, as chat completions renders them; special
tokens not added unless asked), and answers `{"count", "max_model_len", "tokens", "token_strs"}` (the
tokens' strings with `return_token_strs`). /detokenize takes `tokens` and answers `{"prompt"}`. Neither
runs the model: the prompt's length is not checked against the context, `max_model_len` says it.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from disagg_worker.model.tokenizer import Tokenizer
from disagg_worker.request.errors import APIError, bad_request, model_not_found
from disagg_worker.request.limits import RequestLimits
from disagg_worker.server.endpoints.base import FrontendOf, read_json
from disagg_worker.server.protocol import parse_chat
from disagg_worker.server.tool_calls import ChatTools

# The messages are read as chat reads them; the context is /tokenize's answer, not its limit.
_NO_LIMITS = RequestLimits(max_context_len=1 << 40)


def _flag(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise bad_request(f"{key}: must be a boolean", key)
    return v


def _chat_text(tok: Tokenizer, body: dict, model: str) -> str:
    chat = parse_chat(body, model, _NO_LIMITS)
    tools = ChatTools.of(chat.tools, tok.chat_template_source)
    messages, offered = (tools.messages(chat.messages), tools.offered()) if tools else (chat.messages, None)
    try:
        return tok.apply_chat_template(messages, chat.add_generation_prompt, offered)
    except ValueError as e:
        raise APIError(400, f"cannot render the chat template: {e}", param="messages") from e


def tokenize_body(tok: Tokenizer, body: Any, model: str, max_model_len: int) -> dict:
    """The answer to a /tokenize body; a 400 naming the field for a bad one."""
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object.")
    if (body.get("prompt") is None) == (body.get("messages") is None):
        raise bad_request("Exactly one of prompt and messages must be given.", "prompt")
    if body.get("messages") is not None:
        text, special = _chat_text(tok, body, model), _flag(body, "add_special_tokens", False)
    elif isinstance(body["prompt"], str):
        text, special = body["prompt"], _flag(body, "add_special_tokens", True)
    else:
        raise bad_request("prompt: must be a string", "prompt")
    ids = tok.encode(text, add_special_tokens=special)
    strs = [tok.tok.id_to_token(i) for i in ids] if _flag(body, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize_body(tok: Tokenizer, body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object.")
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < tok.vocab_size for i in ids):
        raise bad_request(f"tokens: must be a list of token ids in [0, {tok.vocab_size})", "tokens")
    return {"prompt": tok.decode(ids)}


def add_tokenize_routes(app: web.Application, frontend: FrontendOf, model: str) -> None:
    async def tokenize(request: web.Request) -> web.Response:
        fe = frontend(request)
        body = await read_json(fe, request)
        _check_model(body, model)
        size = len(str(body.get("prompt") or "")) + len(str(body.get("messages") or ""))
        answer = await fe.off_loop(size, tokenize_body, fe.tokenizer, body, model, fe.limits.max_context_len)
        return web.json_response(answer)

    async def detokenize(request: web.Request) -> web.Response:
        fe = frontend(request)
        body = await read_json(fe, request)
        _check_model(body, model)
        size = len(str(body.get("tokens") or ""))
        return web.json_response(await fe.off_loop(size, detokenize_body, fe.tokenizer, body))

    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)


def _check_model(body: Any, model: str) -> None:
    if isinstance(body, dict) and body.get("model") not in (None, model):
        raise model_not_found(str(body["model"]))
