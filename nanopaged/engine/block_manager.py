"""Paged KV memory: free list, ref counts, block tables and the prefix cache."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

from nanopaged.engine.sequence import Sequence


def hash_block(parent_hash: int, token_ids: list[int] | tuple[int, ...]) -> int:
    """Chained xxhash64 of one full block: depends on every token before it via parent_hash."""
    h = xxhash.xxh64(parent_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class BlockManager:
    """Hands out fixed-size KV blocks; shares full blocks by content through a prefix cache.

    A block is free at ref count 0. A freed block keeps its hash, so a later sequence can still
    hit it until it is handed out again; the least recently freed block is handed out first.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
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
        return block_id

    def allocate(self, seq: Sequence, cached_blocks: list[int], num_new_tokens: int) -> bool:
        """Give a sequence with no blocks its cached prefix plus room for num_new_tokens more.

        Returns False, changing nothing, when there are not enough free blocks.
        """
        assert not seq.block_table
        num_cached_tokens = len(cached_blocks) * self.block_size
        num_fresh = self.num_blocks_for(num_cached_tokens + num_new_tokens) - len(cached_blocks)
        num_revived = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        if num_fresh + num_revived > self.num_free_blocks:
            return False
        for b in cached_blocks:
            if self.ref_counts[b] == 0:
                del self.free_blocks[b]
            self.ref_counts[b] += 1
        seq.block_table = cached_blocks + [self._take_free_block() for _ in range(num_fresh)]
        seq.num_computed_tokens = num_cached_tokens
        seq.num_registered_blocks = len(cached_blocks)
        return True

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow seq's block table to hold num_new_tokens past its computed ones; False if full."""
        needed = self.num_blocks_for(seq.num_computed_tokens + num_new_tokens)
        num_fresh = needed - len(seq.block_table)
        if num_fresh > self.num_free_blocks:
            return False
        for _ in range(num_fresh):
            seq.block_table.append(self._take_free_block())
        return True

    def free(self, seq: Sequence) -> None:
        """Drop seq's references; blocks at ref count 0 go back to the free list."""
        # Tail blocks first, so they are reallocated before the shared-prefix blocks.
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0
            if self.ref_counts[block_id] == 0:
                self.free_blocks[block_id] = None
                if self.block_hashes[block_id] is None:
                    # Nothing to keep: hand it out before any block that can still be hit.
                    self.free_blocks.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_registered_blocks = 0

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
