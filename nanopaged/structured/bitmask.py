"""Packed token bitmasks: one int32 word per 32 vocabulary ids, filled for many rows at once."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from nanopaged.structured._llguidance import llguidance
from nanopaged.structured.matcher import GrammarMatcher


def bitmask_words(vocab_size: int) -> int:
    """Words of one bitmask row: ceil(vocab_size / 32)."""
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, num_words: int, pin: bool = False) -> torch.Tensor:
    """A host bitmask [rows, num_words] int32 allowing every token (all bits set); pin: in
    page-locked memory, for copies to the device that overlap the step."""
    return torch.full((rows, num_words), -1, dtype=torch.int32, pin_memory=pin)


class BitmaskFiller:
    """Fills the bitmask rows of many matchers in parallel on llguidance's own threads (no
    GIL held), so the host computes a step's masks while the device runs; advances many
    matchers by one token each the same way."""

    def __init__(self, num_words: int, num_threads: int | None = None) -> None:
        """num_threads: llguidance's own default when None (4 in 5 CPUs, at most 32)."""
        if num_threads is None:
            num_threads = max(1, min(32, 4 * (os.cpu_count() or 1) // 5))
        if num_threads < 1:
            raise ValueError(f"fill_threads must be at least 1, got {num_threads}")
        self.num_words = num_words
        self.num_threads = num_threads
        self._executor = llguidance.LLExecutor(num_threads=num_threads)

    def fill(self, rows: Sequence[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        """Write each (matcher, row)'s allowed tokens into bitmask[row]; other rows are left
        as they are. bitmask: CPU int32 [num_rows, num_words], contiguous. The executor hands
        each thread a contiguous run of the list: rows of one lexer together keep its threads
        off each other's lexer lock, so callers order them so (GrammarMatcher.lexer)."""
        self._check(bitmask)
        if not rows:
            return
        num_rows = bitmask.shape[0]
        for matcher, row in rows:
            assert 0 <= row < num_rows and matcher.num_words == self.num_words, row
        assert len({row for _, row in rows}) == len(rows), "two matchers on one row"
        pairs = [(m._matcher, row) for m, row in rows]
        self._executor.unsafe_compute_mask_ptr(
            pairs, bitmask.data_ptr(), 4 * self.num_words, num_rows
        )

    def fill_rows(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
        """fill() of matchers[k] into bitmask[k], for k < len(matchers)."""
        self._check(bitmask)
        assert len(matchers) <= bitmask.shape[0], (len(matchers), bitmask.shape)
        pairs = [(m._matcher, k) for k, m in enumerate(matchers)]
        self._executor.unsafe_compute_mask_ptr(
            pairs, bitmask.data_ptr(), 4 * self.num_words, bitmask.shape[0]
        )

    def _check(self, bitmask: torch.Tensor) -> None:
        assert bitmask.dtype == torch.int32, bitmask.dtype  # a host tensor
        assert bitmask.dim() == 2 and bitmask.shape[1] == self.num_words, bitmask.shape
        assert bitmask.is_contiguous()

    def accept_one(self, rows: Sequence[tuple[GrammarMatcher, int]]) -> list[bool]:
        """Advance each (matcher, token)'s matcher past its token, in parallel; per row False
        when the token broke the grammar (see GrammarMatcher.accept). One row per matcher,
        each with its version moved on by the caller; rows of one lexer best together, as in
        fill()."""
        if not rows:
            return []
        assert len({id(m) for m, _ in rows}) == len(rows), "a matcher twice"
        return self._executor.consume_token_par([(m._matcher, token) for m, token in rows])
