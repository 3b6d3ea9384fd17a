"""A chat request's prompt and sampling parameters, as chat completions and the Responses API both run it:
the tools (`tool_calls.py`: offered by the template, or written into the prompt for a forced call), the
grammar a forced call or a response format sets, the template rendered, tokenized and admitted."""

from __future__ import annotations

from dataclasses import replace

from disagg_worker.request.errors import APIError
from disagg_worker.request.params import SamplingParams
from disagg_worker.server.frontend import Frontend
from disagg_worker.server.protocol import ChatRequest
from disagg_worker.server.tool_calls import ChatTools


async def chat_input(
    fe: Frontend, req: ChatRequest, max_tokens_key: str = "max_tokens", prompt_param: str = "messages"
) -> tuple[list[int], SamplingParams, ChatTools | None]:
    """(prompt ids, admitted sampling parameters, tools); a 400 naming the field for what cannot run."""
    tools = ChatTools.of(req.tools, fe.tokenizer.chat_template_source)
    sampling = replace(req.sampling, grammar=tools.grammar(req.sampling.grammar)) if tools else req.sampling
    messages = tools.messages(req.messages) if tools else req.messages
    try:
        text = await fe.render_chat(messages, req.add_generation_prompt, tools.offered() if tools else None)
    except ValueError as e:
        raise APIError(400, f"cannot render the chat template: {e}", param=prompt_param) from e
    ids = await fe.encode(text, add_special_tokens=False)
    params = fe.limits.admit(ids, sampling, req.max_tokens_set, max_tokens_key, prompt_param)
    return ids, params, tools
