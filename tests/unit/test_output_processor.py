"""Incremental detokenization gives the full decode's text; stop strings found in it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from nanopaged.engine.output_processor import IncrementalDetokenizer


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    from tiny_models import add_byte_tokenizer
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    add_byte_tokenizer(Path(path))
    return AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_text_equals_full_decode(byte_tokenizer, skip):
    rng = random.Random(0)
    tok = byte_tokenizer
    for trial in range(20):
        # Text a model could write (ASCII, accents, CJK, emoji) with EOS tokens in between.
        words = ["the", " cat", "\u00e9t\u00e9", " \u4e2d\u6587", "\U0001f600", "\n", " 42", "!"]
        ids = []
        for _ in range(rng.randint(1, 20)):
            ids += tok.encode(rng.choice(words)) if rng.random() < 0.9 else [tok.eos_token_id]
        detok = IncrementalDetokenizer(skip)
        for n in range(1, len(ids) + 1, rng.randint(1, 3)):
            detok.update(tok, ids[:n])
        detok.update(tok, ids)
        assert detok.text == tok.decode(ids, skip_special_tokens=skip), trial
        # Each update decodes a window of the newest tokens, not the whole output.
        assert len(ids) - detok.prefix_offset <= 8 or detok.read_offset < len(ids)


def test_multibyte_characters_wait_for_their_last_byte(byte_tokenizer):
    tok = byte_tokenizer
    ids = tok.encode("a\u00e9b\u4e2d")  # two- and three-byte characters, one byte per token
    detok = IncrementalDetokenizer(True)
    for n in range(1, len(ids) + 1):
        text = detok.update(tok, ids[:n])
        assert "\ufffd" not in text
    assert text == "a\u00e9b\u4e2d"
