"""Penalties and min_tokens masks on logits rows, with the per-sequence token counts that
presence/frequency/repetition penalties read, kept on the device.

Each penalized sequence owns a row of two [rows, vocab] tensors: how often each token occurs
in its output (int32) and which tokens its prompt holds (bool). A step adds only what arrived
since the sequence's last penalized step: normally its newest token, taken straight from the
previous step's samples on the device while that step's results are still on their way to the
host (asynchronous scheduling). A row is built from the host's token lists only when its
sequence is first seen or its counts cannot be trusted (a token counted from the device that
never reached the host, or outputs that shrank); rows of finished sequences are reused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from nanopaged.layers.backend import backend_for
from nanopaged.platform import to_device

if TYPE_CHECKING:
    from nanopaged.engine.sequence import Sequence


@dataclass
class _Entry:
    seq: Sequence
    row: int
    counted: int  # output tokens included in the row's counts
    # Output position of a token counted from the device before the host had it (or None).
    pending_at: int | None = None


class PenaltyCounts:
    """Output-token counts and prompt-token sets of the penalized sequences, on `device`."""

    def __init__(self, vocab: int, device: torch.device):
        self.vocab = vocab
        self.device = torch.device(device)
        self.counts = torch.zeros(0, vocab, dtype=torch.int32, device=self.device)
        self.prompt = torch.zeros(0, vocab, dtype=torch.bool, device=self.device)
        self.entries: dict[int, _Entry] = {}  # seq_id -> entry
        self.free: list[int] = []
        self.num_rebuilt = 0  # rows built from host lists (first sight or distrust)

    def update(self, seqs: list[Sequence], pending: torch.Tensor | None = None) -> list[int]:
        """Bring each sequence's row up to date; returns their rows, in order."""
        self._make_room(seqs)
        rows: list[int] = []
        rebuilt: list[int] = []
        out_pairs: list[np.ndarray] = []  # [k, 2] (row, token) of host tokens to count
        prompt_pairs: list[np.ndarray] = []
        waiting: list[tuple[int, int]] = []  # (row, pending_row)
        for seq in seqs:
            entry = self.entries.get(seq.seq_id)
            # Output tokens the host holds (not sliced out: a step needs only the newest).
            known = len(seq.token_ids) - seq.num_prompt_tokens
            if entry is None or entry.seq is not seq or not self._trusted(entry, seq, known):
                if entry is None or entry.seq is not seq:
                    row = self.free.pop() if self.free else self._grow()
                    entry = self.entries[seq.seq_id] = _Entry(seq, row, 0)
                entry.counted, entry.pending_at = 0, None
                rebuilt.append(entry.row)
                prompt = seq.token_ids[: seq.num_prompt_tokens]
                prompt_pairs.append(_pairs(entry.row, prompt))
            if known > entry.counted:
                start = seq.num_prompt_tokens + entry.counted
                out_pairs.append(_pairs(entry.row, seq.token_ids[start:]))
            entry.counted, entry.pending_at = known, None
            if seq.pending_row is not None:
                assert pending is not None, "a pending token needs the previous step's samples"
                waiting.append((entry.row, seq.pending_row))
                entry.counted, entry.pending_at = known + 1, known
            rows.append(entry.row)
        self.num_rebuilt += len(rebuilt)
        if rebuilt:
            idx = torch.as_tensor(rebuilt, dtype=torch.int64, device=self.device)
            self.counts.index_fill_(0, idx, 0)
            self.prompt.index_fill_(0, idx, False)
            self._put(self.prompt, prompt_pairs, accumulate=False)
        self._put(self.counts, out_pairs, accumulate=True)
        if waiting:
            pairs = torch.from_numpy(np.asarray(waiting, dtype=np.int64))
            pairs = pairs.to(self.device, non_blocking=True)
            tokens = pending.index_select(0, pairs[:, 1])
            self.counts.index_put_(
                (pairs[:, 0], tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True
            )
        return rows

    @staticmethod
    def _trusted(entry: _Entry, seq: Sequence, known: int) -> bool:
        # A token counted from the device must have reached the host since (it sits at
        # output position pending_at), and no counted output may have gone away.
        total = known + (seq.pending_row is not None)
        if entry.counted > total:
            return False
        return entry.pending_at is None or entry.pending_at < known

    def _put(self, target: torch.Tensor, pairs: list[np.ndarray], accumulate: bool) -> None:
        if not pairs:
            return
        both = torch.from_numpy(np.concatenate(pairs)).to(self.device, non_blocking=True)
        if both.numel() == 0:
            return
        value = torch.ones(len(both), dtype=target.dtype, device=self.device)
        target.index_put_((both[:, 0], both[:, 1]), value, accumulate=accumulate)

    def _make_room(self, seqs: list[Sequence]) -> None:
        # Rows of finished sequences first, then of sequences absent from this step (a later
        # step rebuilds them), before the tensors grow.
        new = sum(1 for s in seqs if (e := self.entries.get(s.seq_id)) is None or e.seq is not s)
        if new <= len(self.free):
            return
        step_ids = {s.seq_id for s in seqs}
        for absent_too in (False, True):
            for seq_id, entry in list(self.entries.items()):
                if entry.seq.is_finished or (absent_too and seq_id not in step_ids):
                    self.free.append(self.entries.pop(seq_id).row)
            if new <= len(self.free):
                return

    def _grow(self) -> int:
        # Double the rows (at least 8); returns a fresh row and frees the others.
        old = self.counts.shape[0]
        size = max(8, 2 * old)
        counts = torch.zeros(size, self.vocab, dtype=torch.int32, device=self.device)
        prompt = torch.zeros(size, self.vocab, dtype=torch.bool, device=self.device)
        counts[:old] = self.counts
        prompt[:old] = self.prompt
        self.counts, self.prompt = counts, prompt
        self.free.extend(range(size - 1, old, -1))
        return old


def _pairs(row: int, tokens: list[int]) -> np.ndarray:
    """[len(tokens), 2] int64 (row, token)."""
    out = np.empty((len(tokens), 2), dtype=np.int64)
    out[:, 0] = row
    out[:, 1] = tokens
    return out


def penalize(
    logits: torch.Tensor,
    seqs: list[Sequence],
    pending: torch.Tensor | None = None,
    counts: PenaltyCounts | None = None,
) -> torch.Tensor:
    """Apply each sequence's presence/frequency/repetition penalties to its row of logits.

    pending: the previous step's sampled tokens on the device (asynchronous scheduling): a
    sequence whose newest token is still there (pending_row) counts it from there, so the
    counts equal those of a synchronous step. counts: the Sampler's PenaltyCounts, which keeps
    each sequence's counts on the device from step to step (without it they are built here).
    """
    rows = [i for i, s in enumerate(seqs) if s.row.penalties]
    if not rows:
        return logits
    dev = logits.device
    pen = [seqs[i] for i in rows]
    if counts is None:
        counts = PenaltyCounts(logits.shape[-1], dev)
    state_rows = counts.update(pen, pending)
    # [3, n] presence, frequency, repetition; with the row indices: one copy to the device
    host = torch.tensor(
        [
            [s.sampling_params.presence_penalty for s in pen],
            [s.sampling_params.frequency_penalty for s in pen],
            [s.sampling_params.repetition_penalty for s in pen],
            rows,
            state_rows,
        ],
        dtype=torch.float64,
    )
    both = to_device(host, dev, pin=True)
    penalties = both[:3].float()
    logits = logits.to(torch.float32, copy=True)  # one copy, whatever the logits' dtype
    backend_for(dev).penalize_rows(logits, both[3].long(), both[4].long(), counts.counts,
                                   counts.prompt, penalties)  # fmt: skip
    return logits


def mask_early_stops(
    logits: torch.Tensor, seqs: list[Sequence], eos: set[int], outputs: list[int] | None = None
) -> None:
    """Forbid EOS and stop tokens to sequences that have not reached min_tokens (in place):
    one index copy from page-locked memory and one kernel for all rows, so the step stays
    asynchronous (an index list per row copied from pageable memory waited for the device).
    outputs: each sequence's output count before this step's token, when the sequences
    moved on since (a deferred sampler); default their num_output_tokens now."""
    rows: list[int] = []
    cols: list[int] = []
    if outputs is None:
        outputs = [seq.num_output_tokens for seq in seqs]
    for i, (seq, num_outputs) in enumerate(zip(seqs, outputs)):
        p = seq.sampling_params
        # A grammar that can take nothing more allows EOS alone: min_tokens yields to it.
        done = seq.matcher is not None and seq.matcher.is_terminated()
        if num_outputs < seq.row.min_tokens and not done:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos))
            rows += [i] * len(banned)
            cols += banned
    if not rows:
        return
    # index: [2, n] = rows, token ids
    index = to_device(torch.tensor([rows, cols], dtype=torch.long), logits.device, pin=True)
    logits.index_put_((index[0], index[1]), logits.new_full((), float("-inf")))
