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


def _byte_level_char(b: int) -> str:
    """The character a byte-level BPE (GPT-2's alphabet, this tokenizer's) spells byte `b` with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    if b in printable:
        return chr(b)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(b))


def _byte_id(tok: Tokenizer, b: int) -> int:
    found = tok.tok.token_to_id(_byte_level_char(b))
    assert found is not None and tok.tok.decode([found]).encode("utf-8", "replace") in (bytes([b]), b"\xef\xbf\xbd")
    return found


def _byte_ids(tok: Tokenizer) -> list[int]:
    """The token of each lone byte 0x80..0xFF: none completes a character alone."""
    return [_byte_id(tok, b) for b in range(0x80, 0x100)]


@settings(max_examples=100, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_long_runs_of_lone_bytes_stream_as_they_decode_whole(tok, data, skip):
    """Streams that hold text back for long (bytes that complete no character, then some that do) still
    concatenate to the whole decode."""
    pool = _byte_ids(tok)
    other = st.integers(0, tok.vocab_size - 1)
    ids = data.draw(st.lists(st.one_of(st.sampled_from(pool), st.sampled_from(pool), other), max_size=200))
    assert "".join(stream(tok, ids, None, skip)) == tok.decode(ids, skip_special_tokens=skip)


def test_a_stream_that_never_completes_a_character_is_decoded_in_linear_work(tok):
    """Lone 0xFF bytes never complete a UTF-8 character: each push decodes a bounded window, so the ids decoded
    in all grow with the stream's length, not its square (counted, not timed)."""
    ff = _byte_id(tok, 0xFF)

    def work(n: int) -> int:
        decoded = 0
        decode = tok.decode

        def counting(ids: list[int], skip: bool = True) -> str:
            nonlocal decoded
            decoded += len(ids)
            return decode(ids, skip)

        detok = IncrementalDetokenizer(tok)
        detok._tokenizer = type("Counting", (), {"decode": staticmethod(counting)})()  # type: ignore[assignment]
        text = "".join(detok.push(ff) for _ in range(n)) + detok.flush()
        assert text == "\ufffd" * n
        return decoded

    small, large = work(2000), work(8000)
    assert large / small < 4.5  # linear: ~4 for 4x the tokens (quadratic would be ~16)
    assert large < 8000 * 60  # a bounded window per push
