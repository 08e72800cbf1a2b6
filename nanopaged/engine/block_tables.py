"""The step's block-table matrix, rebuilt only where a sequence's table changed."""

from __future__ import annotations

import numpy as np

from nanopaged.engine.sequence import Sequence


class BlockTableBuilder:
    """Keeps last step's [batch, max_blocks] matrix and patches it.

    Between steps a running sequence's table only grows at the end or has its last block
    replaced (copy-on-write); any other change comes with a new sequence id or a fresh admission
    (after preemption the table starts empty, so its length drops). A row is copied again when
    its length or last entry differ from what was sent last time.
    """

    def __init__(self) -> None:
        self.rows: dict[int, int] = {}
        self.tables = np.zeros((0, 1), dtype=np.int32)
        self.lens = np.zeros(0, dtype=np.int64)

    def build(self, seqs: list[Sequence]) -> np.ndarray:
        lens = np.fromiter((len(s.block_table) for s in seqs), dtype=np.int64, count=len(seqs))
        width = max(int(lens.max()), 1)
        prev_idx = np.fromiter(
            (self.rows.get(s.seq_id, -1) for s in seqs), dtype=np.int64, count=len(seqs)
        )
        tables = np.zeros((len(seqs), width), dtype=np.int32)
        known = prev_idx >= 0
        if known.any():
            w = min(width, self.tables.shape[1])
            tables[known, :w] = self.tables[prev_idx[known], :w]
        prev_lens = np.full(len(seqs), -1, dtype=np.int64)
        prev_lens[known] = self.lens[prev_idx[known]]
        last = np.fromiter(
            (s.block_table[-1] if s.block_table else 0 for s in seqs),
            dtype=np.int64,
            count=len(seqs),
        )
        rows = np.arange(len(seqs))
        # A row is stale when its length changed or its last block was swapped for a copy.
        stale = (prev_lens != lens) | (tables[rows, np.maximum(lens - 1, 0)] != last)
        for i in np.flatnonzero(stale).tolist():
            t = seqs[i].block_table
            tables[i, : len(t)] = t
        self.rows = {s.seq_id: i for i, s in enumerate(seqs)}
        self.tables, self.lens = tables, lens
        return tables
