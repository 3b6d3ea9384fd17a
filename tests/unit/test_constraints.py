"""Constrained output beyond response_format: `regex` and `ebnf` (chat, completions, /generate),
`json_schema` in /generate, response_format on completions; one constraint per request; the
sampler follows a regex and an EBNF grammar to their end."""

from __future__ import annotations

import json
import re

import pytest

from disagg_worker.engine.grammar import Grammars
from disagg_worker.engine.sampling import Sampler
from disagg_worker.model.tokenizer import Tokenizer
from disagg_worker.server.constraints import MAX_GRAMMAR_CHARS
from tests.unit.test_grammar import constrained, run
from tests.unit.test_protocol import USER, chat, completion, error, generate

pytest_plugins = ["tests.unit.conftest_model"]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_regex_and_ebnf_become_the_grammar_of_chat_completions_and_generate():
    pattern, ebnf = "(yes|no)", 'root ::= "a" "b"*'
    assert json.loads(chat({"messages": USER, "regex": pattern}).sampling.grammar) == {
        "type": "regex",
        "pattern": pattern,
    }
    assert json.loads(completion({"prompt": "x", "ebnf": ebnf}).sampling.grammar) == {"type": "ebnf", "grammar": ebnf}
    native = generate({"text": "x", "sampling_params": {"regex": pattern}}).sampling.grammar
    assert json.loads(native) == {"type": "regex", "pattern": pattern}


def test_json_schema_in_generate_as_text_or_object_and_response_format_on_completions():
    for given in (json.dumps(SCHEMA), SCHEMA):
        got = generate({"text": "x", "sampling_params": {"json_schema": given}}).sampling.grammar
        assert json.loads(got) == {"type": "json_schema", "schema": SCHEMA}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "strict": True, "schema": SCHEMA}}
    got = completion({"prompt": "x", "response_format": fmt}).sampling.grammar
    assert json.loads(got) == {"type": "json_schema", "schema": SCHEMA}
    assert completion({"prompt": "x", "response_format": {"type": "text"}}).sampling.grammar is None
    assert completion({"prompt": "x"}).sampling.grammar is None


@pytest.mark.parametrize(
    "fn, body, param, says",
    [
        (chat, {"messages": USER, "regex": "a", "ebnf": "root ::= 'a'"}, "ebnf", "cannot be combined with regex"),
        (chat, {"messages": USER, "response_format": {"type": "json_object"}, "regex": "a"}, "regex", "combined"),
        (completion, {"prompt": "x", "regex": ""}, "regex", "non-empty string"),
        (completion, {"prompt": "x", "ebnf": 5}, "ebnf", "non-empty string"),
        (completion, {"prompt": "x", "regex": "a" * (MAX_GRAMMAR_CHARS + 1)}, "regex", "at most"),
        (completion, {"prompt": "x", "response_format": {"type": "yaml"}}, "response_format", "not supported"),
        (generate, {"text": "x", "sampling_params": {"json_schema": "{"}}, "sampling_params.json_schema", "JSON"),
        (generate, {"text": "x", "sampling_params": {"json_schema": [1]}}, "sampling_params.json_schema", "schema"),
        (
            generate,
            {"text": "x", "sampling_params": {"json_schema": "{}", "regex": "a"}},
            "sampling_params.regex",
            "combined",
        ),
    ],
)
def test_bad_constraints_are_a_400_naming_the_field(fn, body, param, says):
    e = error(fn, body)
    assert (e.status, e.param) == (400, param)
    assert says in e.message


@pytest.fixture(scope="module")
def llama(tiny_dirs):
    path = tiny_dirs["llama"]
    tok = Tokenizer.from_path(path)
    return tok, Grammars(str(path), tok.vocab_size, tok.eos_token_ids)


@pytest.mark.parametrize(
    "spec, full",
    [
        ({"type": "regex", "pattern": r"(yes|no), [0-9]{2,4}"}, r"(yes|no), [0-9]{2,4}"),
        ({"type": "ebnf", "grammar": 'root ::= "colour: " ("red" | "green" | "blue")'}, r"colour: (red|green|blue)"),
    ],
)
def test_sampled_text_matches_the_regex_or_grammar_whatever_the_logits(llama, spec, full):
    tok, grammars = llama
    grammar = json.dumps(spec, sort_keys=True)
    states = constrained(grammars, grammar, range(4))
    run(Sampler(tok.vocab_size), states, tok.vocab_size, tok.eos_token_ids)
    for s in states:
        assert s.output_ids[-1] in tok.eos_token_ids
        assert re.fullmatch(full, tok.decode(s.output_ids[:-1])), tok.decode(s.output_ids)


@pytest.mark.parametrize(
    "spec, param",
    [({"type": "regex", "pattern": "(unclosed"}, "regex"), ({"type": "ebnf", "grammar": "root ::= nowhere"}, "ebnf")],
)
def test_a_pattern_or_grammar_that_does_not_compile_names_its_field(llama, spec, param):
    _, grammars = llama
    with pytest.raises(ValueError, match=f"^{param}: "):
        grammars.matcher(json.dumps(spec))
