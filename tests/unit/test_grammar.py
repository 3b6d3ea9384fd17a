"""Structured output in the sampler: whatever the logits, a request with a response_format samples
JSON that follows its schema and ends where the JSON ends."""

from __future__ import annotations

import json

import pytest
import torch

from disagg_worker.engine.grammar import Grammars
from disagg_worker.engine.sampling import Sampler, SamplingParams, SamplingState
from disagg_worker.model.tokenizer import Tokenizer

pytest_plugins = ["tests.unit.conftest_model"]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "colour"],
    "additionalProperties": False,
}
FORMAT = json.dumps({"type": "json_schema", "schema": SCHEMA})


@pytest.fixture(scope="module")
def llama(tiny_dirs):
    path = tiny_dirs["llama"]
    tok = Tokenizer.from_path(path)
    return tok, Grammars(str(path), tok.vocab_size, tok.eos_token_ids)


def constrained(grammars: Grammars, grammar: str, seeds: range, temperature: float = 1.0) -> list[SamplingState]:
    """One sampling state per seed, each with its own matcher of `grammar`."""
    states = []
    for seed in seeds:
        s = SamplingState.create(SamplingParams(temperature=temperature, seed=seed, grammar=grammar), [1])
        s.matcher = grammars.matcher(grammar)
        states.append(s)
    return states


def run(sampler: Sampler, states: list[SamplingState], vocab: int, eos: tuple[int, ...], steps: int = 60):
    """Sample from random logits until every row produced an EOS (or `steps` ran out)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        live = [s for s in states if not (s.output_ids and s.output_ids[-1] in eos)]
        if not live:
            break
        out = sampler.sample(torch.randn(len(live), vocab, generator=gen) * 4, live)
        for s, t in zip(live, out.token_ids, strict=True):
            s.output_ids.append(t)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampled_text_follows_the_schema_and_stops_at_its_end(llama, temperature):
    tok, grammars = llama
    states = constrained(grammars, FORMAT, range(4), temperature)
    free = SamplingState.create(SamplingParams(temperature=temperature, seed=9), [1])  # a batch mate without one
    run(Sampler(tok.vocab_size), [*states, free], tok.vocab_size, tok.eos_token_ids)
    for s in states:
        assert s.output_ids[-1] in tok.eos_token_ids
        answer = json.loads(tok.decode(s.output_ids[:-1]))
        assert set(answer) == {"ok", "colour"} and isinstance(answer["ok"], bool), answer
        assert answer["colour"] in ("red", "green", "blue")
    with pytest.raises(json.JSONDecodeError):  # the mate's random tokens are not JSON
        json.loads(tok.decode(free.output_ids))


def test_decode_resumes_the_grammar_after_the_first_token(llama):
    """Prefill samples token 0 under the grammar; decode's fresh matcher accepts it and goes on."""
    tok, grammars = llama
    one = SamplingState.create(SamplingParams(temperature=1.0, seed=3, grammar=FORMAT), [1])
    one.matcher = grammars.matcher(FORMAT)
    run(Sampler(tok.vocab_size), [one], tok.vocab_size, tok.eos_token_ids)
    prefill = SamplingState.create(SamplingParams(temperature=1.0, seed=3, grammar=FORMAT), [1])
    prefill.matcher = grammars.matcher(FORMAT)
    run(Sampler(tok.vocab_size), [prefill], tok.vocab_size, tok.eos_token_ids, steps=1)
    decode = SamplingState.create(SamplingParams(temperature=1.0, seed=3, grammar=FORMAT), [1])
    decode.matcher = grammars.matcher(FORMAT)
    decode.resume_after(prefill.output_ids[0])
    decode.output_ids.append(prefill.output_ids[0])
    # The same logits each step as the single instance saw: replay its generator from step 1.
    gen = torch.Generator().manual_seed(0)
    steps = [torch.randn(1, tok.vocab_size, generator=gen) * 4 for _ in range(len(one.output_ids))]
    sampler = Sampler(tok.vocab_size)
    for x in steps[1:]:
        decode.output_ids.append(sampler.sample(x, [decode]).token_ids[0])
    assert decode.output_ids == one.output_ids


def test_a_schema_that_does_not_compile_is_a_value_error_naming_response_format(llama):
    _, grammars = llama
    bad = json.dumps({"type": "json_schema", "schema": {"type": "no-such-type"}})
    with pytest.raises(ValueError, match="response_format"):
        grammars.matcher(bad)


BOUNDED = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2, "maxLength": 8},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["city", "tags"],
    "additionalProperties": False,
}


def test_length_bounded_strings_are_valid_json_within_their_bounds(llama):
    """xgrammar alone lets raw control characters into a length-bounded string (invalid JSON)."""
    tok, grammars = llama
    fmt = json.dumps({"type": "json_schema", "schema": BOUNDED})
    states = constrained(grammars, fmt, range(8))
    run(Sampler(tok.vocab_size), states, tok.vocab_size, tok.eos_token_ids, steps=120)
    for s in states:
        assert s.output_ids[-1] in tok.eos_token_ids
        answer = json.loads(tok.decode(s.output_ids[:-1]))  # strict: no raw control characters
        assert len(answer["tags"]) <= 2, answer
        # Lengths count characters. xgrammar takes some malformed UTF-8 (an overlong 4-byte sequence, which
        # a random model's byte tokens can spell and a real model's do not) as one character; decoded,
        # its bytes become one U+FFFD each, so only cleanly decoded strings are held to the bounds here.
        clean = [t for t in [answer["city"], *answer["tags"]] if "\ufffd" not in t]
        assert clean and all(len(t) <= 8 for t in clean), answer
        assert all(len(t) <= 3 for t in answer["tags"] if t in clean), answer
        assert answer["city"] not in clean or len(answer["city"]) >= 2, answer
