"""LazyLogprobs: the list of Logprob dicts users get, made per position when first read."""

from __future__ import annotations

import copy
import pickle
import random
from collections.abc import Sequence

import pytest

import nanopaged.outputs
from nanopaged.outputs import LazyLogprobs, Logprob


def _raw(rng: random.Random, num_positions: int, ranked: str):
    """Engine-side logprobs of random positions: token -> logprob, token -> rank.

    ranked: "all", "none" (ranks=None) or "short" (ranks stop before the last positions).
    """
    entries, ranks = [], []
    for _ in range(num_positions):
        tokens = rng.sample(range(1000), rng.randint(1, 7))
        entries.append({t: -rng.random() * 20 for t in tokens})
        ranks.append({t: rng.randint(1, 1000) for t in tokens if rng.random() < 0.9})
    if ranked == "none":
        return entries, None
    if ranked == "short":
        return entries, ranks[: num_positions // 2]
    return entries, ranks


def _text(token: int) -> str:
    return f"<{token}>"


def _decode(token_ids: list[int]) -> list[str]:
    return [_text(t) for t in token_ids]


def _eager(entries, ranks, with_text: bool) -> list[dict[int, Logprob]]:
    """The Logprob dicts built up front, one position after another."""
    out = []
    for t, entry in enumerate(entries):
        rank_of = ranks[t] if ranks is not None and t < len(ranks) else {}
        out.append(
            {
                tok: Logprob(lp, rank_of.get(tok), _text(tok) if with_text else None)
                for tok, lp in entry.items()
            }
        )
    return out


@pytest.mark.parametrize("ranked", ["all", "none", "short"])
@pytest.mark.parametrize("with_text", [True, False])
def test_equals_the_eager_list_on_random_data(ranked, with_text):
    rng = random.Random(f"{ranked}/{with_text}")
    for num_positions in (0, 1, 5, 63, 64, 65, 200):
        entries, ranks = _raw(rng, num_positions, ranked)
        want = _eager(entries, ranks, with_text)
        decode = _decode if with_text else None
        # Each way of reading, on a fresh container (reads build and cache positions).
        assert LazyLogprobs(entries, ranks, decode) == want
        assert want == LazyLogprobs(entries, ranks, decode)
        assert list(LazyLogprobs(entries, ranks, decode)) == want
        lazy = LazyLogprobs(entries, ranks, decode)
        assert len(lazy) == num_positions
        for i in rng.sample(range(-num_positions, num_positions), min(30, 2 * num_positions)):
            assert lazy[i] == want[i]
        for _ in range(20):
            lazy = LazyLogprobs(entries, ranks, decode)
            bounds = [None, *range(-num_positions - 2, num_positions + 3)]
            s = slice(rng.choice(bounds), rng.choice(bounds), rng.choice([None, 1, 2, -1, -3]))
            assert lazy[s] == want[s] and type(lazy[s]) is list
        lazy = LazyLogprobs(entries, ranks, decode)
        assert list(reversed(lazy)) == want[::-1]
        assert repr(lazy) == repr(want)


def test_unequal_to_other_contents_and_types():
    entries, ranks = _raw(random.Random(1), 10, "all")
    want = _eager(entries, ranks, True)
    lazy = LazyLogprobs(entries, ranks, _decode)
    assert lazy != want[:-1] and lazy != want + [{}]
    changed = copy.deepcopy(want)
    tok = next(iter(changed[4]))
    changed[4][tok].logprob += 1e-9
    assert lazy != changed and changed != lazy
    changed = copy.deepcopy(want)
    changed[7][next(iter(changed[7]))].decoded_token = "x"
    assert lazy != changed
    assert lazy != tuple(want)  # as a list is not equal to a tuple
    assert lazy == LazyLogprobs(entries, ranks, _decode)
    assert lazy != LazyLogprobs(entries, ranks, None)


def test_behaves_as_a_sequence():
    entries, ranks = _raw(random.Random(2), 70, "all")
    want = _eager(entries, ranks, True)
    lazy = LazyLogprobs(entries, ranks, _decode)
    assert isinstance(lazy, Sequence)
    assert want[30] in lazy and {} not in lazy
    assert lazy.index(want[69]) == 69 and lazy.count(want[3]) == 1
    assert lazy[-70] == want[0] and lazy[69] is lazy[-1]  # a position is built once
    for bad in (70, -71):
        with pytest.raises(IndexError):
            lazy[bad]
    with pytest.raises(TypeError):
        lazy["0"]
    with pytest.raises(TypeError):
        hash(lazy)
    assert [d for d in lazy] == want and [d for d in lazy] == want  # iterates again


def test_pickle_and_copy_keep_the_contents():
    entries, ranks = _raw(random.Random(3), 100, "short")
    want = _eager(entries, ranks, True)
    seen = []

    def decode(token_ids):  # a closure: pickle could not carry it
        seen.append(token_ids)
        return _decode(token_ids)

    lazy = LazyLogprobs(entries, ranks, decode)
    lazy[5][next(iter(want[5]))].rank = 0  # a change to a read position travels with it
    want[5][next(iter(want[5]))].rank = 0
    loaded = pickle.loads(pickle.dumps(lazy))
    assert type(loaded) is LazyLogprobs and loaded == want
    assert lazy == want
    unread = LazyLogprobs(entries, ranks, None)
    assert pickle.loads(pickle.dumps(unread)) == _eager(entries, ranks, False)
    for copied in (copy.copy(lazy), copy.deepcopy(lazy)):
        assert type(copied) is LazyLogprobs and copied == want
    shallow = copy.copy(lazy)
    assert shallow[5] is lazy[5]  # as copy.copy of a list: the dicts are shared
    assert copy.deepcopy(lazy)[5] is not lazy[5]


def test_logprobs_are_made_only_for_read_positions(monkeypatch):
    made = []

    class SpyLogprob(Logprob):
        def __init__(self, *args, **kwargs):
            made.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(nanopaged.outputs, "Logprob", SpyLogprob)
    entries, ranks = _raw(random.Random(4), 300, "all")
    lazy = LazyLogprobs(entries, ranks, _decode)
    assert len(lazy) == 300 and made == []
    first = lazy[3]
    assert len(made) == len(entries[3])
    assert lazy[3] is first and lazy[-297] is first and len(made) == len(entries[3])
    lazy[-1]
    lazy[10:13]
    read = [3, 299, 10, 11, 12]
    assert len(made) == sum(len(entries[t]) for t in read)
    assert len(list(lazy)) == 300
    assert len(made) == sum(map(len, entries))  # every position once, however often read


def test_decode_runs_only_for_read_positions():
    calls = []

    def decode(token_ids):
        calls.append(list(token_ids))
        return _decode(token_ids)

    entries, ranks = _raw(random.Random(5), 300, "all")
    lazy = LazyLogprobs(entries, ranks, decode)
    assert calls == []
    lazy[2]
    lazy[-1]
    lazy[2]
    lazy[1:4]
    assert calls == [list(entries[2]), list(entries[299]), [*entries[1], *entries[3]]]
    # Iterating decodes a run of positions per call, each position once.
    calls.clear()
    assert list(lazy) == _eager(entries, ranks, True)
    unread = [t for t in range(300) if t not in (1, 2, 3, 299)]
    assert [tok for c in calls for tok in c] == [tok for t in unread for tok in entries[t]]
    assert len(calls) == 5  # positions 0-63, ..., 256-298
