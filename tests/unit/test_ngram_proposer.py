"""The n-gram proposer against a brute-force prompt lookup."""

from __future__ import annotations

import random

from nanopaged.spec import NgramProposer, SpeculativeConfig


def lookup_ref(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Scan every earlier start, latest first, for each n from the longest down."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n :]
        for s in range(length - n - 1, -1, -1):
            if tokens[s : s + n] == suffix:
                return tokens[s + n : s + n + k]
    return []


def test_worked_examples():
    p = NgramProposer(3, 3, 1)
    seqs = [
        [1, 2, 3, 4, 1, 2],  # 2-gram [1, 2] at 0: [3, 4, 1, 2] followed it, cut to k
        [5, 5, 5, 5],  # 3-gram [5, 5, 5] at 0 overlaps the suffix: one token follows it
        [1, 2, 3],  # nothing repeats
        [7],
        [],
        [1, 9, 4, 1, 8, 4, 1],  # 2-gram [4, 1] at 2 (not the suffix itself at 5)
        [1, 2, 7, 8, 9, 2, 6, 6, 1, 2],  # longest n wins: [1, 2] at 0 beats a later [2]
    ]
    assert p.propose(seqs) == [[3, 4, 1], [5], [], [], [], [8, 4, 1], [7, 8, 9]]
    # Ties go to the latest occurrence: [3] follows both 1s and 2s; the latest [1] is at 4.
    assert NgramProposer(2, 1, 1).propose([[1, 2, 1, 3, 1, 4, 1]]) == [[4, 1]]
    # prompt_lookup_min bounds the shortest n: a lone repeated token is not enough.
    assert NgramProposer(2, 3, 2).propose([[1, 2, 1, 3, 1]]) == [[]]


def test_random_lists_equal_the_reference():
    rng = random.Random(0)
    for trial in range(600):
        k = rng.randint(1, 7)
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        vocab = rng.randint(2, 6)
        seqs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 60))] for _ in range(4)]
        want = [lookup_ref(t, k, min_n, max_n) for t in seqs]
        assert NgramProposer(k, max_n, min_n).propose(seqs) == want, (trial, seqs)


def test_incremental_index_equals_the_reference():
    """Sequences that grow by chunks of any size (a decode step's few tokens, a prompt's many)
    keep one index each, interleaved in one proposer."""
    rng = random.Random(1)
    p = NgramProposer(5, 4, 1)
    seqs = {i: [] for i in range(5)}
    for _ in range(120):
        ids = rng.sample(sorted(seqs), rng.randint(1, len(seqs)))
        for i in ids:
            grow = rng.choice([1, 1, 2, 3, 7, 20, 50])
            seqs[i] += [rng.randrange(4) for _ in range(grow)]
        got = p.propose([seqs[i] for i in ids], ids)
        assert got == [lookup_ref(seqs[i], 5, 1, 4) for i in ids]
    assert max(len(t) for t in seqs.values()) > 300


def test_freed_or_reused_ids_start_over():
    p = NgramProposer(3, 2, 1)
    a = [1, 2, 3, 1, 2]
    assert p.propose([a], [7]) == [[3, 1, 2]]
    # Another sequence under the same id without free(): the stale index is not used.
    b = [4, 5, 6, 4, 5, 6, 9, 4]
    assert p.propose([b], [7]) == [lookup_ref(b, 3, 1, 2)] == [[5, 6, 9]]
    # A sequence whose tokens differ only past the indexed ones is still the same sequence.
    b += [5]
    assert p.propose([b], [7]) == [[6, 9, 4]]
    p.free(7)
    p.free(7)  # no-op
    assert p.propose([a[:4]], [7]) == [[2, 3, 1]]


def test_from_config():
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2,
                                       "prompt_lookup_max": 3, "prompt_lookup_min": 2})
    p = NgramProposer.from_config(cfg)
    assert (p.k, p.min_n, p.max_n) == (2, 2, 3)
    assert p.propose([[1, 2, 3, 4, 1, 2]]) == [[3, 4]]
