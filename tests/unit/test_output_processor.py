"""Incremental detokenization gives the full decode's text; stop strings found in it."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest

from nanopaged.engine.detokenizer import IncrementalDetokenizer, decode_batch
from nanopaged.engine.output_processor import find_stop_strings
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
    import nanopaged.engine.request_output as request_output
    from nanopaged.engine.request_output import OutputBuilder

    tok = byte_tokenizer
    builder = OutputBuilder(tok)
    batches = []

    def spy(tokenizer, token_lists, skip_special_tokens):
        batches.append(token_lists)
        return decode_batch(tokenizer, token_lists, skip_special_tokens)

    monkeypatch.setattr(request_output, "decode_batch", spy)
    rng = random.Random(3)
    ids = _random_ids(tok, rng, 40) + [tok.eos_token_id] * 2
    ids += ids[:5]  # repeated tokens
    decoder = builder.token_decoder()
    assert decoder(ids) == [tok.decode([t]) for t in ids]
    assert len(batches) == 1 and sorted(t for [t] in batches[0]) == sorted(set(ids))
    # Memoized across calls and decoders: only tokens not seen before are decoded.
    more = ids[:10] + [t for t in range(len(tok)) if t not in ids][:3]
    assert builder.token_decoder()(more) == [tok.decode([t]) for t in more]
    assert len(batches) == 2 and sorted(t for [t] in batches[1]) == sorted(more[10:])
    assert builder.token_decoder()(ids) == [tok.decode([t]) for t in ids]
    assert len(batches) == 2
    assert OutputBuilder(None).token_decoder() is None


def _step_hits(find, tok, ids: list[int], stops: list[str], steps: list[int], **kwargs):
    """[(step, index, stop string, full text)] of the first hit as ids arrive steps[i] at a
    time ([] if none): a hit finishes a sequence, so nothing after it is looked for."""
    seq = _seq(tok, stops, **kwargs)
    n = 0
    for i, k in enumerate(steps):
        seq.token_ids += ids[n : n + k]
        n += k
        hits = [(i, idx, stop, full) for s, idx, stop, full in find([seq]) if s is seq]
        if hits:
            return hits
    return []


def _stops_from(text: str, rng: random.Random) -> list[str]:
    """Stop strings that occur in text (of 1-6 characters) and one that does not."""
    stops = ["\u4e2d\u6587!never"]
    for _ in range(rng.randint(1, 3)):
        if len(text) > 1:
            a = rng.randrange(len(text) - 1)
            piece = text[a : a + rng.randint(1, 6)].replace("\ufffd", "")
            if piece:
                stops.append(piece)
    return stops


@pytest.mark.parametrize("skip", [True, False])
def test_byte_matcher_finds_what_the_text_finds(byte_tokenizer, skip):
    """Byte-level stop matching gives find_stop_strings' hits at the same steps: stop strings
    spanning tokens and steps, inside multi-byte characters, after stray bytes of broken
    characters, around EOS (a special token, in the text only without skipping)."""
    from nanopaged.engine.output_processor import StopMatcher

    tok = byte_tokenizer
    matcher = StopMatcher(tok)
    assert matcher.tables() is not None
    rng = random.Random(5)
    words = ["the", " cat", "\u00e9t\u00e9", " \u4e2d\u6587", "\U0001f600", "\n", "!", "ab"]
    num_hits = 0
    for trial in range(60):
        ids = []
        for _ in range(rng.randint(1, 12)):
            r = rng.random()
            if r < 0.7:
                ids += tok.encode(rng.choice(words))
            elif r < 0.85:
                ids.append(tok.eos_token_id)
            else:
                ids += _random_ids(tok, rng, 2)  # stray bytes, two-byte tokens
        text = tok.decode(ids, skip_special_tokens=skip)
        stops = _stops_from(text, rng)
        if not skip and rng.random() < 0.3:
            stops.append("<eos>")
        steps = [rng.randint(1, 3) for _ in range(len(ids))]
        kw = dict(skip_special_tokens=skip)
        want = _step_hits(lambda s: find_stop_strings(s, tok), tok, ids, stops, steps, **kw)
        got = _step_hits(matcher.find, tok, ids, stops, steps, **kw)
        assert got == want, (trial, ids, stops)
        num_hits += bool(want)
    assert num_hits > 30  # the comparison is mostly about hits, not their absence


def test_byte_matcher_on_smollm2_tokenizer(smollm2_hf_tokenizer):
    """The embedded SmolLM2's tokenizer (byte-level BPE with added chat tokens) gets byte
    tables, and they give the text path's hits on text a model writes."""
    from nanopaged.engine.output_processor import StopMatcher, byte_tables

    tok = smollm2_hf_tokenizer
    tables = byte_tables(tok)
    assert tables is not None and len(tables[False]) == len(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tables[False][im_end] == b"<|im_end|>" and tables[True][im_end] == b""
    rng = random.Random(6)
    sentences = ["Paris is the capital of France.", " Caf\u00e9 na\u00efve \u2014 r\u00e9sum\u00e9",
                 "def add(a, b):\n    return a + b\n", " \u65e5\u672c\u8a9e\u306e\u6587",
                 " 3.14159", " \U0001f600\U0001f680 ok"]  # fmt: skip
    matcher = StopMatcher(tok)
    for trial in range(40):
        ids = []
        for _ in range(rng.randint(1, 5)):
            ids += tok.encode(rng.choice(sentences)) if rng.random() < 0.85 else [im_end]
        for skip in (True, False):
            text = tok.decode(ids, skip_special_tokens=skip)
            stops = _stops_from(text, rng)
            steps = [rng.randint(1, 2) for _ in range(len(ids))]
            kw = dict(skip_special_tokens=skip)
            want = _step_hits(lambda s: find_stop_strings(s, tok), tok, ids, stops, steps, **kw)
            assert _step_hits(matcher.find, tok, ids, stops, steps, **kw) == want, trial


def test_byte_matcher_falls_back_to_text(byte_tokenizer):
    """Tokenizers whose decode is not their tokens' bytes (an overridden decode, a decoder
    that is not byte-level, space clean-up) get no byte tables, and a stop string holding
    U+FFFD is matched on text: each still finds its stop strings."""
    from tokenizers import decoders

    from nanopaged.engine.output_processor import StopMatcher, byte_tables

    tok = byte_tokenizer
    shouting = copy.deepcopy(tok)

    class Shouting(type(tok)):
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super()._decode(token_ids, skip_special_tokens, **kwargs).upper()

    shouting.__class__ = Shouting
    other_decoder = copy.deepcopy(tok)
    other_decoder._tokenizer.decoder = decoders.Metaspace()
    cleaning = copy.deepcopy(tok)
    cleaning.clean_up_tokenization_spaces = True
    for t in (shouting, other_decoder, cleaning):
        assert byte_tables(t) is None
    ids = shouting.encode("xyz")
    hits = _step_hits(StopMatcher(shouting).find, shouting, ids, ["YZ"], [1, 1, 1])
    assert [h[:3] for h in hits] == [(2, 1, "YZ")]
    broken = tok.encode("\u00e9")[:1] + tok.encode("ab")  # a stray lead byte, then "ab"
    stops = ["\ufffdab"]
    want = _step_hits(lambda s: find_stop_strings(s, tok), tok, broken, stops, [1, 1, 1])
    assert want and _step_hits(StopMatcher(tok).find, tok, broken, stops, [1, 1, 1]) == want


def test_byte_matcher_ids_past_the_vocabulary_are_empty(byte_tokenizer):
    # A model's vocabulary may be larger than its tokenizer's: decode drops such ids.
    from nanopaged.engine.output_processor import StopMatcher

    tok = byte_tokenizer
    ids = tok.encode("ab") + [len(tok) + 7] + tok.encode("cd")
    assert tok.decode(ids) == "abcd"
    hits = _step_hits(StopMatcher(tok).find, tok, ids, ["bc"], [1] * len(ids))
    assert [h[:3] for h in hits] == [(3, 1, "bc")]


@pytest.mark.parametrize("skip", [True, False])
def test_stop_strings_ignore_the_min_tokens_window(byte_tokenizer, skip):
    """A stop string may only end in text that appears once min_tokens tokens are out: both
    finders, watched as the engine watches (from the token after the first min_tokens), give
    the first occurrence in the full text that ends past the window's text, at the step the
    text first holds one."""
    from nanopaged.engine.output_processor import StopMatcher

    tok = byte_tokenizer
    rng = random.Random(11)
    words = ["ab", " cat", "\u00e9t\u00e9", "!", "ab!", "\n", " \u4e2d"]
    num_early = 0
    for trial in range(80):
        ids = []
        while len(ids) < 24:
            ids += tok.encode(rng.choice(words))
        min_tokens = rng.randint(1, 12)
        early = tok.decode(ids[:min_tokens], skip_special_tokens=skip)
        stops = [rng.choice(["ab", "!", "\u00e9", "t ", "cat"])]
        if early:  # a string the window's text holds, so today's search would stop there
            a = rng.randrange(len(early))
            stops.append(early[a : a + rng.randint(1, 3)].replace("\ufffd", "") or "ab")
        num_early += any(s in early for s in stops)
        floor = len(early)
        want = None
        for t in range(min_tokens + 1, len(ids) + 1):
            full = tok.decode(ids[:t], skip_special_tokens=skip)
            hits = [(full.find(s, max(0, floor - len(s) + 1)), s) for s in stops]
            hits = [h for h in hits if h[0] >= 0]
            if hits and not full.endswith("\ufffd"):
                want = (*min(hits), full)
                break
        for find in (lambda s: find_stop_strings(s, tok), StopMatcher(tok).find):
            seq = _seq(tok, stops, skip_special_tokens=skip, min_tokens=min_tokens)
            seq.token_ids += ids[:min_tokens]
            got = None
            for t in range(min_tokens, len(ids)):
                seq.token_ids.append(ids[t])
                found = find([seq])
                if found:
                    got = found[0][1:]
                    break
            assert got == want, (trial, ids, stops, min_tokens)
    assert num_early > 40  # most trials have a stop string inside the window
