"""Our tokenizer against transformers' on the tiny model: the same ids and the same chat text."""

from __future__ import annotations

import pytest
import transformers

from disagg_worker.model.tokenizer import Tokenizer
from tests.unit.test_tokenizer import MESSAGES, TEXTS

pytest_plugins = ["tests.unit.conftest_model"]


@pytest.fixture(scope="module")
def tok(tiny_dirs) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dirs["llama"])


@pytest.fixture(scope="module")
def hf_tok(tiny_dirs):
    return transformers.AutoTokenizer.from_pretrained(tiny_dirs["llama"])


@pytest.mark.parametrize("text", TEXTS)
def test_encoding_matches_transformers(tok, hf_tok, text):
    assert tok.encode(text) == hf_tok(text).input_ids
    assert tok.encode(text, add_special_tokens=False) == hf_tok(text, add_special_tokens=False).input_ids


def test_chat_template_renders_chatml(tok, hf_tok):
    text = tok.apply_chat_template(MESSAGES)
    assert text == (
        "<s><|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert text == hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert not tok.apply_chat_template(MESSAGES, add_generation_prompt=False).endswith("assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[:2] == [0, 2] and ids.count(3) == 2
