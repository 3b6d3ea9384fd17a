"""A completions batch (several prompts in one request, OpenAI's list of strings or of token lists) through the
router: each prompt becomes its own request, with the batch's other fields and `n`, so that each goes to its own
pair exactly as that prompt sent alone would (`fanout.py` merges the answers, prompt i's choice j as index
i * n + j). The batch is split and bounded as a worker splits and bounds it (`server/protocol.py`); what else is
wrong with a prompt is its worker's to say, in the words a worker uses for a batch's prompt i (`prompt[i]`), but for
one thing: an element that is itself a list of strings or of lists. Sent on alone it would be read as a batch of
its own, not as the one prompt it is in the batch, so the router refuses it as a worker refuses it in the batch.
"""

from __future__ import annotations

from typing import Any

from disagg_worker.request.errors import APIError, bad_request
from disagg_worker.server.protocol import MAX_N, check_batch, split_prompts


def valid_n(n: Any) -> bool:
    return type(n) is int and 1 <= n <= MAX_N


def prompt_bodies(path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The body of each prompt of a completions batch, in order; `[body]` for one prompt, or for a batch whose `n`
    a worker refuses (its 400 names `n`)."""
    if path != "/v1/completions" or body.get("prompt") is None:
        return [body]
    prompts = split_prompts(body["prompt"])
    n = body.get("n", 1)
    if len(prompts) == 1 or not valid_n(n):
        return [body]
    check_batch(len(prompts), n)
    for i, p in enumerate(prompts):
        if isinstance(p, list) and not all(type(t) is int for t in p):
            raise bad_request(f"prompt[{i}]: must be a non-empty string or list of token ids", f"prompt[{i}]")
    return [{**body, "prompt": p} for p in prompts]


def as_batch_prompt(e: BaseException, i: int) -> BaseException:
    """Prompt i's own error as a worker words it in a batch: `prompt` is `prompt[i]`."""
    if not isinstance(e, APIError) or e.param != "prompt":
        return e
    message = f"prompt[{i}]{e.message[len('prompt') :]}" if e.message.startswith("prompt:") else e.message
    return APIError(e.status, message, e.type, f"prompt[{i}]", e.code, e.retry_after)
