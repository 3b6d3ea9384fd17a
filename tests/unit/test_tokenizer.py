"""Tokenizer of the tiny model: round trips, BOS handling, chat template, streaming detokenization."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_worker.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "The lighthouse keeper climbed the stairs.",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u2014 \u201cquoted\u201d \u6771\u4eac and \U0001f680 rockets",
    "  leading spaces, tabs\tand\nnewlines  ",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]

pytest_plugins = ["tests.unit.conftest_model"]


@pytest.fixture(scope="module")
def tok(tiny_dirs) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dirs["llama"])


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip_and_bos(tok, text):
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 0 and ids.count(0) == 1
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids, skip_special_tokens=False) == "<s>" + text


def test_vocab_and_eos_ids(tok):
    assert tok.vocab_size == 2048
    assert tok.eos_token_ids == (1, 3)  # </s> from config.json, <|im_end|> from generation_config.json


def test_template_errors_and_missing_template_are_value_errors(tok, tiny_dirs, tmp_path):
    with pytest.raises(ValueError, match="must be a string"):
        tok.apply_chat_template([{"role": "user", "content": 5}])
    for name in ("tokenizer.json", "config.json"):
        (tmp_path / name).write_bytes((tiny_dirs["llama"] / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    bare = Tokenizer.from_dir(tmp_path)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template(MESSAGES)
    assert bare.eos_token_ids == (1,)


def stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None, skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=skip)
    return [detok.push(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode_without_replacement_chars(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    pieces = stream(tok, ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, 2047), max_size=40),
    prompt_text=st.one_of(st.none(), st.text(max_size=30)),
    skip=st.booleans(),
)
def test_streamed_text_of_random_tokens_equals_full_decode(tok, ids, prompt_text, skip):
    """Random ids include lone bytes of multi-byte characters and special tokens."""
    prompt = None if prompt_text is None else tok.encode(prompt_text)
    assert "".join(stream(tok, ids, prompt, skip)) == tok.decode(ids, skip_special_tokens=skip)
