"""Batches of prompts in /v1/completions (OpenAI's list of strings or of token lists): one request per prompt,
in order, each fitted and checked as a prompt sent alone, the batch bounded in choices."""

from __future__ import annotations

import pytest

from disagg_worker.server.protocol import MAX_BATCH_CHOICES, MAX_N
from tests.unit.test_protocol import CTX, VOCAB, completions, error


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("one", ["one"]),
        ([5, 6], [[5, 6]]),
        (["one", "two", "three"], ["one", "two", "three"]),
        ([[5, 6], [7], [8, 9, 10]], [[5, 6], [7], [8, 9, 10]]),
        (["one", [7, 8]], ["one", [7, 8]]),
    ],
)
def test_completion_takes_openais_four_prompt_forms_one_request_per_prompt_in_order(prompt, expected):
    reqs = completions({"prompt": prompt, "n": 2, "echo": True, "max_tokens": 5, "temperature": 0})
    assert [r.prompt for r in reqs] == expected
    names = ["prompt"] if len(expected) == 1 else [f"prompt[{i}]" for i in range(len(expected))]
    assert [r.param for r in reqs] == names
    assert {(r.n, r.echo, r.sampling.max_new_tokens, r.sampling.temperature) for r in reqs} == {(2, True, 5, 0.0)}


def test_each_token_prompt_of_a_batch_is_fitted_to_the_context_alone():
    reqs = completions({"prompt": [[1] * 2040, [1] * 10, [2] * 2047]})
    assert [r.sampling.max_new_tokens for r in reqs] == [8, 16, 1]
    e = error(completions, {"prompt": [[1] * 10, [1] * 2040], "max_tokens": 9})
    assert (e.status, e.param) == (400, "max_tokens") and "2049" in e.message


@pytest.mark.parametrize("count, n", [(MAX_BATCH_CHOICES, 1), (MAX_BATCH_CHOICES // 4, 4), (2, MAX_N)])
def test_a_batch_up_to_the_bound_of_choices_is_taken(count, n):
    assert len(completions({"prompt": [[3]] * count, "n": n})) == count


@pytest.mark.parametrize("count, n", [(MAX_BATCH_CHOICES + 1, 1), (MAX_BATCH_CHOICES // 4 + 1, 4), (5, MAX_N)])
def test_a_batch_beyond_the_bound_of_choices_is_a_400_naming_prompt(count, n):
    # Bounded before its prompts are read: empty ones would be a 400 of their own.
    e = error(completions, {"prompt": [""] * count, "n": n})
    assert (e.status, e.type, e.param) == (400, "invalid_request_error", "prompt")
    assert f"{count * n} choices" in e.message and f"at most {MAX_BATCH_CHOICES}" in e.message


@pytest.mark.parametrize(
    "prompt, says",
    [
        (["ok", ""], "must not be empty"),
        ([[1], []], "non-empty string or list of token ids"),
        (["ok", 5], "non-empty string or list of token ids"),
        (["ok", None], "non-empty string or list of token ids"),
        ([[1], [2, "x"]], "token ids"),
        ([[1], [-1]], "token ids"),
        ([[1], [VOCAB]], "outside the vocabulary"),
        ([[1], [1] * CTX], "maximum context length"),
        (["ok", "x\ud800"], "Unicode"),
    ],
)
def test_a_bad_prompt_of_a_batch_is_a_400_naming_which(prompt, says):
    e = error(lambda body: completions(body, VOCAB), {"prompt": prompt})
    assert (e.status, e.type, e.param) == (400, "invalid_request_error", "prompt[1]")
    assert says in e.message, e.message
