"""Completions with `echo` and `logprobs`: a streamed answer's text offsets are the whole answer's."""

from __future__ import annotations

import pytest

from disagg_worker.model.tokenizer import Tokenizer
from disagg_worker.server.endpoints.base import Choice
from disagg_worker.server.endpoints.completions import CompletionFormat, Echo
from disagg_worker.server.frontend import Delta

pytest_plugins = ["tests.unit.conftest_model"]


@pytest.fixture(scope="module")
def tok(tiny_dirs) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dirs["llama"])


def test_the_first_streamed_chunk_offsets_the_answer_once_past_the_echoed_prompt(tok):
    prompt = "Once upon"
    prompt_ids = tok.encode(prompt)
    answer_ids = tok.encode(" a time there", add_special_tokens=False)
    pieces = [tok.decode([i]) for i in answer_ids]
    echo = Echo(prompt_ids, prompt, only=False, logprobs=True)
    lps, prompt_lps = [-0.5] * len(answer_ids), [-1.0] * (len(prompt_ids) - 1)

    whole_choice = Choice(0, text="".join(pieces), token_ids=answer_ids, logprobs=lps, top_logprobs=[])
    whole_choice.prompt_logprobs = prompt_lps
    whole = CompletionFormat("m", tok, [echo]).body([whole_choice], len(prompt_ids))["choices"][0]["logprobs"]

    streamed, fmt, sent = [], CompletionFormat("m", tok, [echo]), Choice(0)
    for k, (i, piece) in enumerate(zip(answer_ids, pieces, strict=True)):
        d = Delta(piece, [i], [-0.5], [], prompt_logprobs=prompt_lps if k == 0 else None)
        chunk = fmt.chunk(0, d, sent, first=k == 0)["choices"][0]["logprobs"]
        streamed += chunk["text_offset"]
        sent.add(d)
    assert streamed == whole["text_offset"]
    assert whole["text_offset"][len(prompt_ids)] == len(prompt)  # the answer starts where the prompt ends
