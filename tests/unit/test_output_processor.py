"""Incremental detokenization gives the full decode's text; stop strings found in it."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest

from nanopaged.engine.output_processor import (
    IncrementalDetokenizer,
    decode_batch,
    find_stop_strings,
)
from nanopaged.engine.sequence import Sequence
from nanopaged.sampling_params import SamplingParams


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


def _random_ids(tok, rng: random.Random, n: int) -> list[int]:
    """Any ids of the vocabulary: stray bytes of multi-byte characters, EOS, two-byte tokens."""
    return [rng.randrange(len(tok)) for _ in range(n)]


@pytest.mark.parametrize("skip", [True, False])
def test_decode_batch_equals_decode(byte_tokenizer, skip):
    tok = byte_tokenizer
    rng = random.Random(1)
    lists = [_random_ids(tok, rng, rng.randint(0, 6)) for _ in range(300)]
    lists += [[tok.eos_token_id], [tok.eos_token_id, 65], tok.encode("\u00e9t\u00e9 \u4e2d")]
    want = [tok.decode(ids, skip_special_tokens=skip) for ids in lists]
    assert decode_batch(tok, lists, skip) == want


def test_decode_batch_keeps_an_overridden_decode(byte_tokenizer):
    tok = copy.deepcopy(byte_tokenizer)

    class Shouting(type(tok)):
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super()._decode(token_ids, skip_special_tokens, **kwargs).upper()

    tok.__class__ = Shouting
    ids = tok.encode("abc")
    assert decode_batch(tok, [ids], True) == ["ABC"]


def _reference_texts(tok, ids: list[int], skip: bool) -> list[str]:
    """The detokenizer's text after each token, with both windows decoded every step."""
    text, prefix_offset, read_offset, out = "", 0, 0, []
    for n in range(1, len(ids) + 1):
        prefix = tok.decode(ids[prefix_offset:read_offset], skip_special_tokens=skip)
        full = tok.decode(ids[prefix_offset:n], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            text += full[len(prefix) :]
            prefix_offset, read_offset = read_offset, n
        out.append(text)
    return out


@pytest.mark.parametrize("skip", [True, False])
def test_reused_window_text_gives_the_same_text(byte_tokenizer, skip):
    # Random ids leave many windows ending in an incomplete character: those steps reuse the
    # text of the window's read tokens instead of decoding it again.
    tok = byte_tokenizer
    rng = random.Random(2)
    for trial in range(30):
        ids = _random_ids(tok, rng, 40)
        detok = IncrementalDetokenizer(skip)
        texts = [detok.update(tok, ids[:n]) for n in range(1, len(ids) + 1)]
        assert texts == _reference_texts(tok, ids, skip), trial


def _seq(tok, stop: list[str], **kwargs) -> Sequence:
    return Sequence(tok.encode("prompt"), SamplingParams(stop=stop, max_tokens=100, **kwargs))


def test_stop_string_split_over_tokens_and_steps(byte_tokenizer):
    tok = byte_tokenizer
    # "stop!" arrives over three steps of two tokens each: found at the third, not before.
    seq = _seq(tok, ["stop!", "zz"])
    found_at = []
    for i, text in enumerate(("xs", "to", "p!", "yy")):
        seq.token_ids += tok.encode(text)
        for s, idx, stop, full in find_stop_strings([seq], tok):
            assert s is seq
            found_at.append((i, idx, stop, full))
    assert found_at[0] == (2, 1, "stop!", "xstop!")


def test_long_stop_string_one_character_per_step(byte_tokenizer):
    tok = byte_tokenizer
    text = "ab" * 10 + "abcdefgh" + "ij"
    seq = _seq(tok, ["abcdefgh", "q"])
    hits = []
    for i, token in enumerate(tok.encode(text)):  # one byte per token
        seq.token_ids.append(token)
        hits += [(i, idx, stop) for _, idx, stop, _ in find_stop_strings([seq], tok)]
    assert hits[0] == (27, 20, "abcdefgh")


def test_stop_string_in_a_multibyte_character_waits_for_it(byte_tokenizer):
    tok = byte_tokenizer
    seq = _seq(tok, ["\u4e2d"])
    found = []
    for i, token in enumerate(tok.encode("a\u4e2d")):  # "a", then the 3 bytes of the character
        seq.token_ids.append(token)
        found += [(i, idx) for _, idx, _, _ in find_stop_strings([seq], tok)]
    assert found[0] == (3, 1)


def test_token_decoder_decodes_new_tokens_once_in_a_batch(byte_tokenizer, monkeypatch):
    import nanopaged.llm
    from nanopaged.llm import LLM

    tok = byte_tokenizer
    llm = LLM.__new__(LLM)  # only the tokenizer and its cache are used
    llm.tokenizer, llm._decoded_tokens = tok, {}
    batches = []

    def spy(tokenizer, token_lists, skip_special_tokens):
        batches.append(token_lists)
        return decode_batch(tokenizer, token_lists, skip_special_tokens)

    monkeypatch.setattr(nanopaged.llm, "decode_batch", spy)
    rng = random.Random(3)
    ids = _random_ids(tok, rng, 40) + [tok.eos_token_id] * 2
    ids += ids[:5]  # repeated tokens
    decoder = llm._token_decoder()
    assert decoder(ids) == [tok.decode([t]) for t in ids]
    assert len(batches) == 1 and sorted(t for [t] in batches[0]) == sorted(set(ids))
    # Memoized across calls and decoders: only tokens not seen before are decoded.
    more = ids[:10] + [t for t in range(len(tok)) if t not in ids][:3]
    assert llm._token_decoder()(more) == [tok.decode([t]) for t in more]
    assert len(batches) == 2 and sorted(t for [t] in batches[1]) == sorted(more[10:])
    assert llm._token_decoder()(ids) == [tok.decode([t]) for t in ids]
    assert len(batches) == 2
    llm.tokenizer = None
    assert llm._token_decoder() is None
