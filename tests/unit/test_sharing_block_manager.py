"""BlockManager sharing: fork, copy-on-write, swap to the CPU pool, kv_stats; a hypothesis
machine checks that every sequence still reads its own KV through any mix of them."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from nanopaged.engine.block_manager import BlockManager
from nanopaged.engine.sequence import Sequence
from nanopaged.sampling_params import SamplingParams

BS = 4


def _seq(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams())


def _prefill(bm: BlockManager, seq: Sequence) -> None:
    cached = bm.get_computed_blocks(seq)
    assert bm.allocate(seq, cached, len(seq) - len(cached) * BS)
    seq.num_computed_tokens = len(seq)
    bm.cache_full_blocks(seq)


def _decode(bm: BlockManager, seq: Sequence, token: int, copies: list) -> bool:
    """Append one token and reserve its slot, like a decode step."""
    seq.token_ids.append(token)
    return bm.append_slots(seq, 1, copies)


def test_fork_shares_every_block():
    bm = BlockManager(16, BS)
    parent = _seq(range(10))  # blocks: 2 full + 1 partial
    _prefill(bm, parent)
    child = parent.fork()
    bm.fork(parent, child)
    assert child.block_table == parent.block_table and child.seq_id != parent.seq_id
    assert all(bm.ref_counts[b] == 2 for b in parent.block_table)
    assert bm.num_shared_blocks == 3 and bm.num_used_blocks == 3
    bm.free(parent)
    assert bm.num_shared_blocks == 0 and all(bm.ref_counts[b] == 1 for b in child.block_table)
    bm.free(child)
    assert bm.num_free_blocks == 16


def test_copy_on_write_only_for_the_shared_partial_block():
    bm = BlockManager(16, BS)
    parent = _seq(range(10))
    _prefill(bm, parent)
    table = list(parent.block_table)
    children = [parent.fork() for _ in range(2)]
    for c in children:
        bm.fork(parent, c)
    copies: list[tuple[int, int]] = []
    assert bm.blocks_needed([(s, 1) for s in [parent, *children]]) == 2
    for i, s in enumerate([parent, *children]):
        assert _decode(bm, s, 100 + i, copies)
    # Two of the three holders copy the partial block; the last writes into it in place.
    assert [src for src, _ in copies] == [table[2], table[2]]
    assert parent.block_table[:2] == children[0].block_table[:2] == table[:2]
    assert children[1].block_table[2] == table[2]
    assert len({parent.block_table[2], children[0].block_table[2], table[2]}) == 3
    assert [bm.ref_counts[b] for b in table] == [3, 3, 1]
    # Filling the copies up to the block boundary, then crossing it, needs no more copies.
    copies.clear()
    for s in [parent, *children]:
        assert _decode(bm, s, 7, copies)  # 12 tokens: the third block is full
        s.num_computed_tokens = len(s)
        assert _decode(bm, s, 8, copies)  # a fresh, private fourth block
    assert copies == []


def test_block_aligned_fork_needs_no_copy():
    bm = BlockManager(16, BS)
    parent = _seq(range(8))  # exactly two full blocks
    _prefill(bm, parent)
    child = parent.fork()
    bm.fork(parent, child)
    copies: list[tuple[int, int]] = []
    assert bm.blocks_needed([(parent, 1), (child, 1)]) == 2  # a new block each, no copy
    assert _decode(bm, parent, 1, copies) and _decode(bm, child, 2, copies)
    assert copies == [] and parent.block_table[:2] == child.block_table[:2]


def test_append_slots_fails_cleanly_when_the_copy_does_not_fit():
    bm = BlockManager(3, BS)
    parent = _seq(range(10))
    _prefill(bm, parent)
    child = parent.fork()
    bm.fork(parent, child)
    copies: list[tuple[int, int]] = []
    assert not _decode(bm, parent, 1, copies)
    assert copies == [] and bm.ref_counts == [2, 2, 2]


def test_kv_stats_counts_shared_cached_and_slots():
    bm = BlockManager(8, BS)
    a = _seq(range(10))  # 3 blocks, 10 of 12 slots
    _prefill(bm, a)
    b = a.fork()
    bm.fork(a, b)
    stats = bm.kv_stats([a, b])
    assert (stats.num_used_blocks, stats.num_shared_blocks) == (3, 3)
    assert stats.slot_utilization == 10 / 12
    bm.free(a)
    bm.free(b)
    stats = bm.kv_stats([])
    assert stats.num_used_blocks == 0 and stats.num_cached_free_blocks == 2  # the full ones
    assert stats.peak_used_blocks == 3 and stats.peak_shared_blocks == 3


def test_swap_out_and_in_keep_sharing():
    bm = BlockManager(8, BS, num_cpu_blocks=6)
    a = _seq(range(10))
    _prefill(bm, a)
    b = a.fork()
    bm.fork(a, b)
    copies: list[tuple[int, int]] = []
    _decode(bm, a, 50, copies)  # a: private copy of the partial block
    a.num_computed_tokens = b.num_computed_tokens = 11
    assert bm.can_swap_out([a, b])
    out = bm.swap_out([a, b])
    assert len(out) == 4  # 2 shared full blocks + 2 partial ones, each copied once
    assert bm.num_free_blocks == 8 and bm.cpu_pool.num_free_blocks == 2
    assert a.block_table[:2] == b.block_table[:2]  # shared in the CPU pool too
    assert bm.cpu_pool.ref_counts[a.block_table[0]] == 2
    assert not bm.can_swap_in([a, b], num_lookahead=5)
    cpu_ids = {*a.block_table, *b.block_table}
    back = bm.swap_in([a, b])
    assert {c for c, _ in back} == cpu_ids and len(back) == 4
    assert bm.cpu_pool.num_free_blocks == 6 and bm.num_used_blocks == 4
    assert a.block_table[:2] == b.block_table[:2] and bm.num_shared_blocks == 2


def test_swap_out_refused_when_the_pool_is_small():
    bm = BlockManager(8, BS, num_cpu_blocks=2)
    a = _seq(range(10))
    _prefill(bm, a)
    assert not bm.can_swap_out([a])


class SharingMachine(RuleBasedStateMachine):
    """Admit, decode, fork, free, swap out and in; a shadow cache follows every block move.

    content[block][slot] is the token prefix whose KV was written there. Copy-on-write pairs
    and swaps move shadow content like the runner moves KV; the invariant is that each
    sequence finds its own prefixes through its block table, and that ref counts, the free
    list and the shared count match the tables.
    """

    @initialize(
        num_blocks=st.integers(4, 20),
        block_size=st.sampled_from([1, 2, 4]),
        caching=st.booleans(),
        num_cpu_blocks=st.integers(0, 12),
    )
    def setup(self, num_blocks, block_size, caching, num_cpu_blocks):
        self.bm = BlockManager(num_blocks, block_size, caching, num_cpu_blocks)
        self.bs = block_size
        self.content: dict[int, list] = {}
        self.cpu_content: dict[int, list] = {}
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []

    def _write(self, seq: Sequence, start: int, end: int) -> None:
        for p in range(start, end):
            block = seq.block_table[p // self.bs]
            self.content.setdefault(block, [None] * self.bs)[p % self.bs] = tuple(
                seq.token_ids[: p + 1]
            )

    def _copy(self, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:
            self.content[dst] = list(self.content.get(src, [None] * self.bs))

    @precondition(lambda self: len(self.running) + len(self.swapped) < 6)
    @rule(stem=st.sampled_from([(1, 2, 3, 4, 5, 6), (1, 2, 3, 9), (7,)]), extra=st.integers(0, 5))
    def admit(self, stem, extra):
        seq = _seq(list(stem) + list(range(20, 20 + extra)))
        cached = self.bm.get_computed_blocks(seq)
        n = len(seq) - len(cached) * self.bs
        if self.bm.allocate(seq, cached, n):
            self._write(seq, seq.num_computed_tokens, len(seq))
            seq.num_computed_tokens = len(seq)
            self.bm.cache_full_blocks(seq)
            self.running.append(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data, token):
        seq = data.draw(st.sampled_from(self.running))
        if len(seq) >= 24:
            return
        seq.token_ids.append(token)
        copies: list[tuple[int, int]] = []
        if not self.bm.append_slots(seq, 1, copies):
            seq.token_ids.pop()
            return
        self._copy(copies)
        self._write(seq, seq.num_computed_tokens, len(seq))
        seq.num_computed_tokens = len(seq)
        self.bm.cache_full_blocks(seq)

    @precondition(lambda self: self.running and len(self.running) + len(self.swapped) < 6)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.running))
        child = parent.fork()
        self.bm.fork(parent, child)
        self.running.append(child)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.running))
        self.bm.free(seq)
        self.running.remove(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def swap_out(self, data):
        seqs = data.draw(st.lists(st.sampled_from(self.running), min_size=1, unique=True))
        if not self.bm.can_swap_out(seqs):
            return
        for src, dst in self.bm.swap_out(seqs):
            self.cpu_content[dst] = list(self.content.get(src, [None] * self.bs))
        for s in seqs:
            self.running.remove(s)
            self.swapped.append(s)

    @precondition(lambda self: self.swapped)
    @rule()
    def swap_in(self):
        if not self.bm.can_swap_in(self.swapped):
            return
        for src, dst in self.bm.swap_in(self.swapped):
            self.content[dst] = list(self.cpu_content[src])
        self.running += self.swapped
        self.swapped = []

    @invariant()
    def each_sequence_reads_its_own_kv(self):
        for seq in getattr(self, "running", []):
            for p in range(seq.num_computed_tokens):
                block = seq.block_table[p // self.bs]
                assert self.content[block][p % self.bs] == tuple(seq.token_ids[: p + 1])

    @invariant()
    def counts_match_tables(self):
        if not hasattr(self, "bm"):
            return
        bm = self.bm
        refs = [0] * bm.num_blocks
        for seq in self.running:
            for b in seq.block_table:
                refs[b] += 1
        assert refs == bm.ref_counts
        assert set(bm.free_blocks) == {b for b in range(bm.num_blocks) if refs[b] == 0}
        assert bm.num_shared_blocks == sum(1 for r in refs if r > 1)
        cpu_refs = [0] * bm.cpu_pool.num_blocks
        for seq in self.swapped:
            for b in seq.block_table:
                cpu_refs[b] += 1
        assert cpu_refs == bm.cpu_pool.ref_counts
        assert bm.cpu_pool.num_free_blocks == sum(1 for r in cpu_refs if r == 0)


SharingMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_sharing_machine = SharingMachine.TestCase
