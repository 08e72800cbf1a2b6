"""BlockManager: allocation, ref counts, prefix hits, collision guard, reallocation order."""

from __future__ import annotations

import pytest

from nanopaged.engine import block_manager as bm_module
from nanopaged.engine.block_manager import BlockManager
from nanopaged.engine.sequence import Sequence
from nanopaged.sampling_params import SamplingParams

BS = 4


def _seq(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams())


def _admit(bm: BlockManager, seq: Sequence) -> list[int]:
    """Allocate like the scheduler: cached prefix, then compute and register the rest."""
    cached = bm.get_computed_blocks(seq)
    assert bm.allocate(seq, cached, len(seq) - len(cached) * BS)
    seq.num_computed_tokens = len(seq)
    bm.cache_full_blocks(seq)
    return cached


def test_allocate_and_free_restore_counts():
    bm = BlockManager(10, BS)
    seq = _seq(range(9))  # 3 blocks
    assert _admit(bm, seq) == []
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 7
    assert all(bm.ref_counts[b] == 1 for b in seq.block_table)
    bm.free(seq)
    assert bm.num_free_blocks == 10 and seq.block_table == []
    assert bm.ref_counts == [0] * 10


def test_allocate_fails_without_side_effects():
    bm = BlockManager(3, BS)
    seq = _seq(range(13))  # 4 blocks
    assert not bm.allocate(seq, [], 13)
    assert bm.num_free_blocks == 3 and seq.block_table == []


def test_prefix_hit_shares_blocks_and_counts_refs():
    bm = BlockManager(16, BS)
    a = _seq(range(10))  # full blocks [0..3], [4..7]; partial [8, 9]
    _admit(bm, a)
    b = _seq(list(range(8)) + [50, 51, 52])
    cached = _admit(bm, b)
    assert cached == a.block_table[:2]
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert [bm.ref_counts[x] for x in a.block_table[:2]] == [2, 2]
    bm.free(a)
    assert [bm.ref_counts[x] for x in b.block_table[:2]] == [1, 1]
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_freed_block_is_still_hit_until_reallocated():
    bm = BlockManager(4, BS)
    a = _seq(range(9))
    _admit(bm, a)
    table = list(a.block_table)
    bm.free(a)
    b = _seq(range(9))
    assert bm.get_computed_blocks(b) == table[:2]
    # Fill the cache with other content: the cached blocks get reallocated and stop hitting.
    c = _seq(range(100, 116))
    _admit(bm, c)
    assert bm.get_computed_blocks(_seq(range(9))) == []


def test_hit_never_covers_the_last_token():
    bm = BlockManager(8, BS)
    a = _seq(range(8))  # exactly two full blocks
    _admit(bm, a)
    b = _seq(range(8))
    assert bm.get_computed_blocks(b) == a.block_table[:1]


def test_hash_collision_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: 1234)
    bm = BlockManager(8, BS)
    _admit(bm, _seq(range(5)))
    other = _seq([9, 9, 9, 9, 9])
    assert bm.get_computed_blocks(other) == []


def test_parent_is_part_of_the_key():
    bm = BlockManager(8, BS)
    _admit(bm, _seq([1, 2, 3, 4, 5, 6, 7, 8, 0]))
    # Same second block, different first block: no hit at all.
    assert bm.get_computed_blocks(_seq([0, 2, 3, 4, 5, 6, 7, 8, 0])) == []


def test_least_recently_freed_is_reallocated_first():
    bm = BlockManager(6, BS)
    a, b = _seq(range(8)), _seq(range(100, 108))
    _admit(bm, a)
    _admit(bm, b)
    table_a, table_b = list(a.block_table), list(b.block_table)
    bm.free(a)
    bm.free(b)
    c = _seq(range(200, 204))
    assert bm.allocate(c, [], 4)
    # Unhashed blocks go first, then a's blocks (freed before b's), tail block first.
    x = _seq(range(300, 312))
    assert bm.allocate(x, [], 12)
    assert x.block_table[0] not in table_a + table_b
    assert x.block_table[1:] == [table_a[1], table_a[0]]
    assert bm.get_computed_blocks(_seq(range(100, 108))) == table_b[:1]


def test_append_slots_grows_table():
    bm = BlockManager(4, BS)
    seq = _seq(range(4))
    assert bm.allocate(seq, [], 4)
    seq.num_computed_tokens = 4
    seq.token_ids.append(7)
    assert bm.append_slots(seq, 1)
    assert len(seq.block_table) == 2
    seq.num_computed_tokens = 5
    assert bm.append_slots(seq, 3) and len(seq.block_table) == 2
    assert not bm.append_slots(seq, 12)  # would need 3 more blocks, 2 free
    assert len(seq.block_table) == 2


def test_prefix_caching_off_never_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    _admit(bm, _seq(range(9)))
    assert bm.get_computed_blocks(_seq(range(9))) == []
    assert bm.hash_to_block == {}


@pytest.mark.parametrize("n", [1, 4, 5])
def test_num_blocks_for(n):
    assert BlockManager(2, BS).num_blocks_for(n) == -(-n // BS)
