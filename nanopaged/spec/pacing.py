"""Which rows propose drafts in a step: a row whose proposer keeps finding nothing waits a few
steps before it asks again, so that the steps where no row proposes run ahead.

A step that verifies drafts is synchronous (the next step's drafts come from its tokens), and
so is any step before one in which a row proposes: the row's newest token must be on the host.
Were every row to propose in every step, every step at or below disable_by_batch_size would be
synchronous, drafts or not (bench.py's random weights, whose tokens the n-gram lookup rarely
finds again, ran at 0.96x of no speculation). After m proposals in a row that found no draft,
a row waits 2^m - 1 steps, at most MAX_WAIT; a proposal that finds drafts ends the wait.
Rejected drafts do not count: a draft model always proposes, and its rows are never paced.

MAX_WAIT: spec_bench's edit workload (SmolLM2's greedy tokens replayed through the n-gram
proposer, with an H200's step times: 0.84 ms run ahead, 1.25 ms synchronous, 1.55 ms
verifying) came to 1.69x of no speculation without waits at k = 8 (lookups 1..4), and 1.76x,
1.77x, 1.76x, 1.76x with waits of at most 1, 3, 7, 15 steps; at k = 4 (lookups 2..4) 1.37x,
then 1.44x, 1.45x, 1.47x, 1.46x. Measured on the H200 at k = 8: 1.60x before, 1.99-2.05x
after (docs/performance.md).
"""

from __future__ import annotations

MAX_WAIT = 7


class DraftPacing:
    """Each speculating sequence's misses in a row and the steps it still waits."""

    def __init__(self) -> None:
        self._rows: dict[int, tuple[int, int]] = {}  # seq_id -> (misses, steps to wait)

    def step(self, seq_id: int) -> tuple[bool, bool]:
        """Count one step of the sequence's: (it may propose in this step, it may in the next:
        this step must then bring its token to the host)."""
        misses, wait = self._rows.get(seq_id, (0, 0))
        if not wait:
            return True, True
        self._rows[seq_id] = (misses, wait - 1)
        return False, wait == 1

    def record(self, seq_id: int, found: bool) -> None:
        """A proposal's outcome: whether it found drafts."""
        misses = 0 if found else min(self._rows.get(seq_id, (0, 0))[0] + 1, 16)
        if misses:
            self._rows[seq_id] = (misses, min(2**misses - 1, MAX_WAIT))
        else:
            self._rows.pop(seq_id, None)

    def forget(self, seq_id: int) -> None:
        """Drop a sequence that finished or left (no-op if it has no record)."""
        self._rows.pop(seq_id, None)

    def forget_all(self) -> None:
        self._rows.clear()
