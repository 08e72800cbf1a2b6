"""Paged KV memory: free list, ref counts, block tables, prefix cache, fork/CoW and swap."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import xxhash

from nanopaged.engine.sequence import Sequence
from nanopaged.engine.swap import CpuBlockPool


def hash_block(parent_hash: int, token_ids: list[int] | tuple[int, ...]) -> int:
    """Chained xxhash64 of one full block: depends on every token before it via parent_hash."""
    h = xxhash.xxh64(parent_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


@dataclass
class KVStats:
    """A snapshot of the device KV pool (and of the CPU swap pool)."""

    num_blocks: int
    num_used_blocks: int
    num_shared_blocks: int  # ref count > 1
    num_cached_free_blocks: int  # free, but still holding a prefix-cache hash
    slot_utilization: float  # token slots holding a token / slots of the used blocks; 0: none
    peak_used_blocks: int  # highest num_used_blocks since reset_peaks (each LLM run resets)
    peak_shared_blocks: int
    num_cpu_blocks: int = 0
    num_used_cpu_blocks: int = 0


class BlockManager:
    """Hands out fixed-size KV blocks; shares full blocks by content through a prefix cache.

    A block is free at ref count 0. A freed block keeps its hash, so a later sequence can still
    hit it until it is handed out again; the least recently freed block is handed out first.
    Forked sequences share all their blocks by reference count; the first write into a shared,
    partially filled block copies it (copy-on-write). Full blocks are never written again, so
    they stay shared. With num_cpu_blocks > 0, whole groups of sequences can be swapped out to
    a CPU pool and back.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_cpu_blocks: int = 0,
    ):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        # (parent hash, tokens) of each cached block: the guard against hash collisions.
        self.block_keys: list[tuple[int, tuple[int, ...]] | None] = [None] * num_blocks
        # Insertion order is reallocation order: the head is handed out first.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.num_shared_blocks = 0  # blocks at ref count > 1, kept up to date by _incref/_decref
        self.peak_used_blocks = 0
        self.peak_shared_blocks = 0
        self.cpu_pool = CpuBlockPool(num_cpu_blocks)

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _seq_block_hash(self, seq: Sequence, i: int) -> int:
        """Hash of seq's full block i, memoised on the sequence (hashes depend on tokens only)."""
        bs = self.block_size
        while len(seq.block_hashes) <= i:
            j = len(seq.block_hashes)
            parent = seq.block_hashes[j - 1] if j else 0
            seq.block_hashes.append(hash_block(parent, seq.token_ids[j * bs : (j + 1) * bs]))
        return seq.block_hashes[i]

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Longest run of seq's leading full blocks already in the cache (not yet taken).

        At least one token is always left to compute, so a prompt fully covered by the cache
        still produces logits: its last full block is recomputed into a fresh block.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        for i in range((len(seq) - 1) // bs):
            h = self._seq_block_hash(seq, i)
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            parent = seq.block_hashes[i - 1] if i else 0
            if self.block_keys[block_id] != (parent, tuple(seq.token_ids[i * bs : (i + 1) * bs])):
                break  # a hash collision: same hash, other content
            hits.append(block_id)
        return hits

    # ---- allocation ----------------------------------------------------------------------
    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        h = self.block_hashes[block_id]
        if h is not None:  # evict its cache entry: its content is about to change
            if self.hash_to_block.get(h) == block_id:
                del self.hash_to_block[h]
            self.block_hashes[block_id] = None
            self.block_keys[block_id] = None
        assert self.ref_counts[block_id] == 0
        self.ref_counts[block_id] = 1
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)
        return block_id

    def allocate(self, seq: Sequence, cached_blocks: list[int], num_new_tokens: int) -> bool:
        """Give a sequence with no blocks its cached prefix plus room for num_new_tokens more.

        Returns False, changing nothing, when there are not enough free blocks.
        """
        return self.allocate_group([seq], [cached_blocks], [num_new_tokens])

    def allocate_group(
        self, seqs: list[Sequence], cached: list[list[int]], num_new_tokens: list[int]
    ) -> bool:
        """allocate() for several sequences at once (the sequences of one group): all or none.

        Every cached block of every sequence is taken back from the free list before any fresh
        block is handed out, so a fresh block for one sequence can never be a cached-but-free
        block that another of them was promised as holding its KV.
        """
        bs = self.block_size
        revived = {b for blocks in cached for b in blocks if self.ref_counts[b] == 0}
        num_fresh = [
            self.num_blocks_for(len(blocks) * bs + n) - len(blocks)
            for blocks, n in zip(cached, num_new_tokens)
        ]
        if sum(num_fresh) + len(revived) > self.num_free_blocks:
            return False
        for seq, blocks in zip(seqs, cached):
            assert not seq.block_table
            for b in blocks:
                if self.ref_counts[b] == 0:
                    del self.free_blocks[b]
                self._incref(b)
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)
        for seq, blocks, k in zip(seqs, cached, num_fresh):
            seq.block_table = blocks + [self._take_free_block() for _ in range(k)]
            seq.num_computed_tokens = len(blocks) * bs
            seq.num_registered_blocks = len(blocks)
        return True

    def append_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        blocks_to_copy: list[tuple[int, int]] | None = None,
    ) -> bool:
        """Grow seq's block table to hold num_new_tokens past its computed ones; False if full.

        When the block the first new token goes into is shared (a fork left it partially
        filled), seq gets a fresh copy of it instead (copy-on-write) and the (src, dst) pair is
        appended to blocks_to_copy, for the runner to copy before the step's forward pass.
        """
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        shared = self._shared_write_block(seq, num_new_tokens)
        num_fresh = max(0, needed - len(seq.block_table)) + (shared is not None)
        if num_fresh > self.num_free_blocks:
            return False
        if shared is not None:
            assert blocks_to_copy is not None, "a shared block is written: pass blocks_to_copy"
            assert self.block_hashes[seq.block_table[shared]] is None  # cached blocks are full
            src = seq.block_table[shared]
            dst = self._take_free_block()
            self._decref(src)  # others still hold it: ref count stays >= 1
            seq.block_table[shared] = dst
            blocks_to_copy.append((src, dst))
        for _ in range(needed - len(seq.block_table)):
            seq.block_table.append(self._take_free_block())
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back seq's blocks past those that num_tokens tokens fill: room a speculating
        step took for drafts that were rejected. Those blocks hold no token of seq (nor of a
        fork of it), so they are seq's alone and in no cache."""
        keep = self.num_blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            assert self.ref_counts[block_id] == 1 and self.block_hashes[block_id] is None
            self._decref(block_id)

    def _shared_write_block(self, seq: Sequence, num_new_tokens: int) -> int | None:
        """Index in seq's table of the shared block its next token would be written into."""
        i = seq.num_computed_tokens // self.block_size
        if num_new_tokens > 0 and i < len(seq.block_table):
            if self.ref_counts[seq.block_table[i]] > 1:
                return i
        return None

    def blocks_needed(self, work: list[tuple[Sequence, int]]) -> int:
        """Free blocks that append_slots would take for each (seq, num_new_tokens), in order.

        Counts copy-on-write exactly: of the sequences sharing a block, the last one to write
        into it finds it no longer shared and writes in place.
        """
        return self._count_appends(work, self.ref_counts)

    def _count_appends(self, work: list[tuple[Sequence, int]], ref_counts: list[int]) -> int:
        """blocks_needed over tables whose blocks have the given ref counts."""
        total = 0
        refs: dict[int, int] = {}
        for seq, n in work:
            total += max(0, self.num_blocks_for(seq.num_computed_tokens + n) - len(seq.block_table))
            i = seq.num_computed_tokens // self.block_size
            if n > 0 and i < len(seq.block_table):
                b = seq.block_table[i]
                left = refs.get(b, ref_counts[b])
                if left > 1:
                    total += 1
                    refs[b] = left - 1
        return total

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give child parent's blocks, shared by reference count."""
        assert not child.block_table
        child.block_table = list(parent.block_table)
        for block_id in child.block_table:
            self._incref(block_id)

    # ---- swapping (preemption by swap) ---------------------------------------------------
    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        unique = {b for seq in seqs for b in seq.block_table}
        return len(unique) <= self.cpu_pool.num_free_blocks

    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Move seqs' blocks to the CPU pool (a block they share is copied once).

        Returns the (device block, cpu block) pairs to copy; tables then hold CPU block ids.
        Device blocks go back to the free list with their hashes, still hittable.
        """
        mapping: dict[int, int] = {}
        for seq in seqs:
            table = []
            for block_id in seq.block_table:
                cpu_id = mapping.get(block_id)
                if cpu_id is None:
                    cpu_id = mapping[block_id] = self.cpu_pool.allocate()
                else:
                    self.cpu_pool.incref(cpu_id)
                table.append(cpu_id)
            for block_id in reversed(seq.block_table):
                self._decref(block_id)
            seq.block_table = table
            seq.num_registered_blocks = 0
        return list(mapping.items())

    def can_swap_in(self, seqs: list[Sequence], num_lookahead: int = 0) -> bool:
        unique = {b for seq in seqs for b in seq.block_table}
        return len(unique) + num_lookahead <= self.num_free_blocks

    def blocks_to_swap_in(self, work: list[tuple[Sequence, int]]) -> int:
        """Free device blocks that swap_in of a swapped-out group, then append_slots of each
        (seq, num_new_tokens), would take. The group's tables hold CPU block ids; a CPU block's
        ref count is the number of the group's sequences sharing it."""
        unique = {b for seq, _ in work for b in seq.block_table}
        return len(unique) + self._count_appends(work, self.cpu_pool.ref_counts)

    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Bring swapped-out seqs back into fresh device blocks; returns (cpu, device) pairs."""
        mapping: dict[int, int] = {}
        for seq in seqs:
            table = []
            for cpu_id in seq.block_table:
                block_id = mapping.get(cpu_id)
                if block_id is None:
                    block_id = mapping[cpu_id] = self._take_free_block()
                else:
                    self._incref(block_id)
                table.append(block_id)
                self.cpu_pool.decref(cpu_id)
            seq.block_table = table
        return list(mapping.items())

    # ---- statistics ----------------------------------------------------------------------
    def reset_peaks(self) -> None:
        self.peak_used_blocks = self.num_used_blocks
        self.peak_shared_blocks = self.num_shared_blocks

    def kv_stats(self, seqs: list[Sequence]) -> KVStats:
        """Pool counts, and how full the used blocks are given seqs, those holding them."""
        bs = self.block_size
        filled: dict[int, int] = {}
        for seq in seqs:
            for i, block_id in enumerate(seq.block_table):
                n = min(bs, max(0, seq.num_computed_tokens - i * bs))
                filled[block_id] = max(filled.get(block_id, 0), n)
        used = self.num_used_blocks
        cached_free = sum(1 for b in self.free_blocks if self.block_hashes[b] is not None)
        return KVStats(
            num_blocks=self.num_blocks,
            num_used_blocks=used,
            num_shared_blocks=self.num_shared_blocks,
            num_cached_free_blocks=cached_free,
            slot_utilization=sum(filled.values()) / (used * bs) if used else 0.0,
            peak_used_blocks=self.peak_used_blocks,
            peak_shared_blocks=self.peak_shared_blocks,
            num_cpu_blocks=self.cpu_pool.num_blocks,
            num_used_cpu_blocks=self.cpu_pool.num_blocks - self.cpu_pool.num_free_blocks,
        )

    def free(self, seq: Sequence) -> None:
        """Drop seq's references; blocks at ref count 0 go back to the free list."""
        # Tail blocks first, so they are reallocated before the shared-prefix blocks.
        for block_id in reversed(seq.block_table):
            self._decref(block_id)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def _incref(self, block_id: int) -> None:
        self.ref_counts[block_id] += 1
        if self.ref_counts[block_id] == 2:
            self.num_shared_blocks += 1
            self.peak_shared_blocks = max(self.peak_shared_blocks, self.num_shared_blocks)

    def _decref(self, block_id: int) -> None:
        """Drop one reference; at ref count 0 the block goes back to the free list."""
        self.ref_counts[block_id] -= 1
        refs = self.ref_counts[block_id]
        assert refs >= 0
        if refs == 1:
            self.num_shared_blocks -= 1
        elif refs == 0:
            self.free_blocks[block_id] = None
            if self.block_hashes[block_id] is None:
                # Nothing to keep: hand it out before any block that can still be hit.
                self.free_blocks.move_to_end(block_id, last=False)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register seq's blocks that are full of computed tokens in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        for i in range(seq.num_registered_blocks, num_full):
            block_id = seq.block_table[i]
            h = self._seq_block_hash(seq, i)
            if self.block_hashes[block_id] is not None or h in self.hash_to_block:
                continue  # already cached, or another block holds the same content
            parent = seq.block_hashes[i - 1] if i else 0
            self.block_hashes[block_id] = h
            self.block_keys[block_id] = (parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
            self.hash_to_block[h] = block_id
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def forget(self, block_ids: list[int]) -> None:
        """Take these blocks out of the prefix cache (their contents are no longer what their
        hashes promise)."""
        for block_id in block_ids:
            h = self.block_hashes[block_id]
            if h is not None and self.hash_to_block.get(h) == block_id:
                del self.hash_to_block[h]
            self.block_hashes[block_id] = self.block_keys[block_id] = None

    def reset_prefix_cache(self, in_use_too: bool = False) -> bool:
        """Forget every cached block (e.g. after the weights changed); False, and nothing
        forgotten, while some block is in use, unless in_use_too (blocks in use then keep
        their contents but are never hit again)."""
        if self.num_used_blocks and not in_use_too:
            return False
        self.hash_to_block.clear()
        self.block_hashes = [None] * self.num_blocks
        self.block_keys = [None] * self.num_blocks
        return True

    def free_all(self) -> None:
        """Drop every reference at once, e.g. after an aborted step; cached blocks stay hittable.

        Repairs whatever an interrupted allocate/free left half done, so it is safe to call
        when no sequence may hold blocks any more, whatever state the lists were left in.
        """
        for h, block_id in list(self.hash_to_block.items()):
            if self.block_hashes[block_id] != h:
                del self.hash_to_block[h]
        for block_id in range(self.num_blocks):
            h = self.block_hashes[block_id]
            if h is not None and self.hash_to_block.get(h) != block_id:
                self.block_hashes[block_id] = self.block_keys[block_id] = None
            self.ref_counts[block_id] = 0
            if block_id not in self.free_blocks:
                self.free_blocks[block_id] = None
        self.num_shared_blocks = 0
        self.cpu_pool.free_all()
