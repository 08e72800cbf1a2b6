"""Random programs against the BlockManager keep its invariants (hypothesis state machine).

The machine drives the BlockManager the way the Scheduler does (prefix lookup + allocate,
append_slots with copy-on-write, compute, cache_full_blocks, fork, free, preempt = free +
reset, free_all after an aborted step) and keeps a shadow of what each physical block holds:
for every slot, the whole token prefix whose KV was written there. That shadow is what makes
the checks strong: a prefix hit or a fork is only right if the shared blocks hold KV computed
over exactly this sequence's prefix. (Swapping has its own machine in
test_sharing_block_manager.py.)

To add an operation, write one more @rule that calls it and keeps `self.seqs`,
`self.scheduled` and `self.content` up to date; the invariants need no change.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from nanopaged.engine import block_manager as bm_module
from nanopaged.engine.block_manager import BlockManager
from nanopaged.engine.sequence import Sequence
from nanopaged.sampling_params import SamplingParams

# A small alphabet and shared stems, so prompts often share leading blocks.
STEMS = ([1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3], [1, 2, 3, 3, 2, 1, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0])
MAX_SEQS = 8
MAX_LEN = 40
PARAMS = SamplingParams()


def _chain_hashes(tokens: tuple[int, ...], block_size: int) -> list[int]:
    """Chained hashes of every full block of `tokens`, computed from scratch."""
    hashes, parent = [], 0
    for i in range(len(tokens) // block_size):
        parent = bm_module.hash_block(parent, tokens[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


class BlockManagerMachine(RuleBasedStateMachine):
    """Scheduler-like programs over one BlockManager, checked against a shadow KV cache."""

    @initialize(
        num_blocks=st.integers(2, 24),
        block_size=st.sampled_from([1, 2, 4]),
        caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.bm = BlockManager(num_blocks, block_size, caching)
        self.bs = block_size
        # content[block][slot]: the token prefix whose last token's KV was written there.
        self.content: dict[int, list[tuple[int, ...] | None]] = {}
        self.seqs: list[Sequence] = []  # live: waiting (no blocks) or running (blocks)
        self.scheduled: dict[int, int] = {}  # seq_id -> tokens reserved, not yet computed
        self.history: list[list[int]] = []  # tokens of sequences that had KV computed

    # ---- helpers -------------------------------------------------------------------------
    def _running(self) -> list[Sequence]:
        return [s for s in self.seqs if s.block_table]

    def _waiting(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.block_table]

    def _snapshot(self) -> tuple:
        bm = self.bm
        return (
            list(bm.ref_counts),
            list(bm.free_blocks),
            dict(bm.hash_to_block),
            list(bm.block_hashes),
            [list(s.block_table) for s in self.seqs],
        )

    def _new_seq(self, tokens: list[int]) -> Sequence:
        seq = Sequence(tokens[:MAX_LEN], PARAMS)
        self.seqs.append(seq)
        self.scheduled[seq.seq_id] = 0
        return seq

    def _remember(self, seq: Sequence) -> None:
        if seq.num_computed_tokens >= self.bs:
            self.history = [list(seq.token_ids)] + self.history[:7]

    # ---- rules ---------------------------------------------------------------------------
    @precondition(lambda self: len(self.seqs) < MAX_SEQS)
    @rule(
        stem=st.integers(0, len(STEMS) - 1),
        keep=st.integers(1, 12),
        tail=st.lists(st.integers(0, 3), max_size=10),
    )
    def add_seq(self, stem: int, keep: int, tail: list[int]) -> None:
        self._new_seq(STEMS[stem][:keep] + tail)

    @precondition(lambda self: len(self.seqs) < MAX_SEQS)
    @rule(pick=st.integers(0, MAX_SEQS), keep=st.integers(1, MAX_LEN), tail=st.lists(
        st.integers(0, 3), max_size=4))  # fmt: skip
    def add_seq_sharing_prefix(self, pick: int, keep: int, tail: list[int]) -> None:
        """A prompt that starts like a live sequence (prompt and generated tokens): prefix hits."""
        if not self.seqs:
            return
        other = self.seqs[pick % len(self.seqs)]
        self._new_seq(other.token_ids[:keep] + tail)

    @precondition(lambda self: len(self.seqs) < MAX_SEQS)
    @rule(
        pick=st.integers(0, 2 * MAX_SEQS),
        keep=st.integers(1, MAX_LEN),
        tail=st.lists(st.integers(0, 3), max_size=4),
        chunk=st.integers(1, 16),
    )
    def prefix_hit(self, pick: int, keep: int, tail: list[int], chunk: int) -> None:
        """Admit a prompt that starts like a sequence computed before: live (its blocks are
        shared) or gone (its freed blocks are revived from the free list)."""
        sources = [list(s.token_ids) for s in self.seqs if s.num_computed_tokens] + self.history
        if not sources:  # compute one first
            first = self._new_seq(STEMS[pick % len(STEMS)] + tail)
            self.run_seq(self.seqs.index(first), chunk, 0)
            if len(self.seqs) == MAX_SEQS or not first.num_computed_tokens:
                return
            sources = [list(first.token_ids)]
        seq = self._new_seq(sources[pick % len(sources)][:keep] + tail)
        self.admit(self._waiting().index(seq), chunk)

    @rule(pick=st.integers(0, MAX_SEQS), chunk=st.integers(1, 16))
    def admit(self, pick: int, chunk: int) -> None:
        """Scheduler admission: prefix-cache lookup, then allocate the first chunk."""
        waiting = self._waiting()
        if not waiting:
            return
        seq = waiting[pick % len(waiting)]
        cached = self.bm.get_computed_blocks(seq)
        num_cached_tokens = len(cached) * self.bs
        assert len(set(cached)) == len(cached)
        assert num_cached_tokens < len(seq), "at least one token must be left to compute"
        if not self.bm.enable_prefix_caching:
            assert cached == []
        for p in range(num_cached_tokens):  # a hit must hold KV of exactly this prefix
            assert self.content[cached[p // self.bs]][p % self.bs] == tuple(seq.token_ids[: p + 1])
        num_new = min(len(seq) - num_cached_tokens, chunk)
        before = self._snapshot()
        if not self.bm.allocate(seq, cached, num_new):
            assert self._snapshot() == before, "a failed allocate must change nothing"
            event("allocate refused")
            return
        if cached:
            revived = any(self.bm.ref_counts[b] == 1 for b in cached)
            event("prefix hit, revived a freed block" if revived else "prefix hit, shared")
        else:
            event("allocate without hit")
        assert seq.num_computed_tokens == num_cached_tokens
        assert seq.block_table[: len(cached)] == cached
        self.scheduled[seq.seq_id] = num_new

    @rule(
        picks=st.lists(st.integers(0, MAX_SEQS), min_size=2, max_size=3),
        chunk=st.integers(1, 16),
    )
    def admit_group(self, picks: list[int], chunk: int) -> None:
        """Admission of a group's waiting sequences (a preempted n > 1 request coming back):
        every prefix lookup first, then one all-or-nothing allocation. A fresh block for one
        sequence must never be a cached block another of them was promised."""
        waiting = self._waiting()
        if len(waiting) < 2:
            return
        seqs = list({id(s): s for s in (waiting[p % len(waiting)] for p in picks)}.values())
        if len(seqs) < 2:
            return
        cached = [self.bm.get_computed_blocks(s) for s in seqs]
        counts = [min(len(s) - len(c) * self.bs, chunk) for s, c in zip(seqs, cached)]
        before = self._snapshot()
        if not self.bm.allocate_group(seqs, cached, counts):
            assert self._snapshot() == before, "a failed allocate must change nothing"
            event("group allocate refused")
            return
        event("group allocated")
        for seq, c, n in zip(seqs, cached, counts):
            assert seq.block_table[: len(c)] == c
            for p in range(len(c) * self.bs):  # still the KV of exactly this prefix
                assert self.content[c[p // self.bs]][p % self.bs] == tuple(seq.token_ids[: p + 1])
            fresh = seq.block_table[len(c) :]
            others = {b for s in self.seqs if s is not seq for b in s.block_table}
            assert not set(fresh) & others, "a fresh block is also in another table"
            self.scheduled[seq.seq_id] = n

    def _busy(self) -> list[Sequence]:
        """Sequences with slots reserved for tokens not yet computed."""
        return [s for s in self.seqs if self.scheduled[s.seq_id]]

    def _ready(self) -> list[Sequence]:
        """Running sequences with tokens left to compute and none scheduled yet."""
        return [
            s for s in self._running()
            if s.num_computed_tokens < len(s) and not self.scheduled[s.seq_id]
        ]  # fmt: skip

    @rule(pick=st.integers(0, MAX_SEQS), chunk=st.integers(1, 16))
    def append_slots(self, pick: int, chunk: int) -> None:
        """A running sequence's next prefill chunk or decode token gets its slots."""
        ready = self._ready()
        if not ready:
            return
        seq = ready[pick % len(ready)]
        num_new = min(len(seq) - seq.num_computed_tokens, chunk)
        before = self._snapshot()
        copies: list[tuple[int, int]] = []
        if not self.bm.append_slots(seq, num_new, copies):
            assert self._snapshot() == before and not copies, "a refusal must change nothing"
            event("append_slots refused")
            return
        for src, dst in copies:  # what the runner does before the step's forward pass
            assert self.bm.ref_counts[dst] == 1 and dst in seq.block_table
            self.content[dst] = list(self.content[src])
            event("copy-on-write")
        self.scheduled[seq.seq_id] = num_new

    @precondition(lambda self: len(self.seqs) < MAX_SEQS)
    @rule(pick=st.integers(0, MAX_SEQS), token=st.integers(0, 3))
    def fork(self, pick: int, token: int) -> None:
        """n > 1 / beam search: a child shares every block of its parent by reference, then
        takes its own sampled token and reserves its slot (copy-on-write if it is shared)."""
        parents = [s for s in self._running() if not self.scheduled[s.seq_id]]
        if not parents:
            return
        parent = parents[pick % len(parents)]
        child = parent.fork()
        self.bm.fork(parent, child)
        assert child.block_table == parent.block_table
        assert child.num_computed_tokens == parent.num_computed_tokens
        self.seqs.append(child)
        self.scheduled[child.seq_id] = 0
        event("fork")
        if child.num_computed_tokens == len(child) - 1:  # the sampled token is not computed
            child.token_ids[-1] = token
            child.block_hashes = child.block_hashes[: child.num_computed_tokens // self.bs]
            self.append_slots(self._ready().index(child), 1)

    @rule(pick=st.integers(0, MAX_SEQS), token=st.integers(0, 3))
    def compute(self, pick: int, token: int) -> None:
        """The model writes the scheduled tokens' KV; the scheduler caches full blocks and,
        when the sequence reached its end, appends a sampled token."""
        busy = self._busy()
        if not busy:
            return
        seq = busy[pick % len(busy)]
        bs = self.bs
        start, n = seq.num_computed_tokens, self.scheduled[seq.seq_id]
        for p in range(start, start + n):
            block = seq.block_table[p // bs]
            # Writing into a block another sequence reads, or one the prefix cache serves,
            # would corrupt someone else's KV.
            assert self.bm.ref_counts[block] == 1, f"write into shared block {block}"
            assert self.bm.block_hashes[block] is None, f"write into cached block {block}"
            self.content.setdefault(block, [None] * bs)[p % bs] = tuple(seq.token_ids[: p + 1])
        seq.num_computed_tokens += n
        self.scheduled[seq.seq_id] = 0
        self.bm.cache_full_blocks(seq)
        if seq.num_computed_tokens == len(seq) and len(seq) < MAX_LEN:
            seq.token_ids.append(token)

    @rule(pick=st.integers(0, MAX_SEQS), act=st.integers(0, 3))
    def free(self, pick: int, act: int) -> None:
        """A sequence finishes (or is aborted while waiting): its blocks go back."""
        if not self.seqs or act != 2:
            return  # rarer than admitting and computing, so several sequences live at once
        seq = self.seqs.pop(pick % len(self.seqs))
        self._remember(seq)
        self.bm.free(seq)
        assert seq.block_table == []
        del self.scheduled[seq.seq_id]

    @rule(pick=st.integers(0, MAX_SEQS), act=st.integers(0, 3))
    def preempt(self, pick: int, act: int) -> None:
        """Preemption by recompute: free, forget progress, wait again with all tokens kept."""
        running = self._running()
        if not running or act != 2:
            return
        seq = running[pick % len(running)]
        self._remember(seq)
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        self.scheduled[seq.seq_id] = 0

    @rule(pick=st.integers(0, MAX_SEQS), chunk=st.integers(1, 16), decode=st.integers(0, 6))
    def run_seq(self, pick: int, chunk: int, decode: int) -> None:
        """Several scheduler steps of one sequence: admit, prefill in chunks, decode a few."""
        if not self.seqs:
            return
        seq = self.seqs[pick % len(self.seqs)]
        if not seq.block_table:
            self.admit(self._waiting().index(seq), chunk)
        target = len(seq) + decode
        while seq.block_table:
            if self.scheduled[seq.seq_id]:
                self.compute(self._busy().index(seq), pick)
            elif seq.num_computed_tokens < min(len(seq), target):
                before = self.scheduled[seq.seq_id]
                self.append_slots(self._ready().index(seq), chunk)
                if self.scheduled[seq.seq_id] == before:
                    return  # no free block: the scheduler would preempt or wait
            else:
                return

    @rule(act=st.integers(0, 7))
    def abort_all(self, act: int) -> None:
        """An interrupted generate: every block back at once; cached content stays usable."""
        if act != 5:
            return  # rare, so programs grow long enough to share blocks
        event("free_all with blocks held" if self.bm.num_used_blocks else "free_all idle")
        for seq in self.seqs:
            self._remember(seq)
        self.bm.free_all()
        self.seqs.clear()
        self.scheduled.clear()
        assert self.bm.num_free_blocks == self.bm.num_blocks

    # ---- invariants ----------------------------------------------------------------------
    @invariant()
    def ref_counts_equal_table_holders(self) -> None:
        holders = [0] * self.bm.num_blocks
        for seq in self.seqs:
            assert len(set(seq.block_table)) == len(seq.block_table)
            for b in seq.block_table:
                holders[b] += 1
        assert self.bm.ref_counts == holders

    @invariant()
    def free_and_used_partition_blocks(self) -> None:
        bm = self.bm
        free = set(bm.free_blocks)
        used = {b for b in range(bm.num_blocks) if bm.ref_counts[b] > 0}
        assert len(free) == len(bm.free_blocks) == bm.num_free_blocks
        assert not free & used and free | used == set(range(bm.num_blocks))
        assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
        assert bm.num_shared_blocks == sum(1 for r in bm.ref_counts if r > 1)

    @invariant()
    def hashes_point_at_matching_blocks(self) -> None:
        bm, bs = self.bm, self.bs
        if not bm.enable_prefix_caching:
            assert not bm.hash_to_block and all(h is None for h in bm.block_hashes)
        for h, b in bm.hash_to_block.items():
            assert bm.block_hashes[b] == h
            parent, tokens = bm.block_keys[b]
            assert len(tokens) == bs and bm_module.hash_block(parent, tokens) == h
            # What the block really holds: KV over one whole prefix, whose chain hash is h.
            slots = self.content[b]
            prefix = slots[-1]
            assert prefix is not None and prefix[-bs:] == tokens
            assert all(slots[j] == prefix[: len(prefix) - bs + j + 1] for j in range(bs))
            assert _chain_hashes(prefix, bs)[-1] == h
        for b, h in enumerate(bm.block_hashes):
            assert h is None or bm.hash_to_block.get(h) == b

    @invariant()
    def tables_cover_tokens(self) -> None:
        bm, bs = self.bm, self.bs
        for seq in self.seqs:
            reserved = seq.num_computed_tokens + self.scheduled[seq.seq_id]
            if not seq.block_table:
                assert reserved == 0
                continue
            assert reserved <= len(seq)
            # Room for every computed and scheduled token, and at most one block to spare.
            assert len(seq.block_table) == bm.num_blocks_for(reserved)
            for p in range(seq.num_computed_tokens):  # and its KV is its own
                got = self.content[seq.block_table[p // bs]][p % bs]
                assert got == tuple(seq.token_ids[: p + 1])


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(
    max_examples=1000,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
