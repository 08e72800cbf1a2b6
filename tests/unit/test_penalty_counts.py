"""PenaltyCounts: counts kept across steps equal counts built from the token lists, with
tokens pending on the device, sequences joining, leaving, pausing and losing a token."""

from __future__ import annotations

import random

import torch

from nanopaged.engine.sequence import Sequence, SequenceStatus
from nanopaged.sampling.penalties import PenaltyCounts
from nanopaged.sampling_params import SamplingParams

VOCAB = 50


def _seq(rng: random.Random) -> Sequence:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
    return Sequence(prompt, SamplingParams(frequency_penalty=0.5))


def _seen_and_counts(state: PenaltyCounts, seqs: list[Sequence], pending=None):
    """What penalize reads for seqs: seen (prompt or output) and output counts, by row."""
    rows = torch.tensor(state.update(seqs, pending), dtype=torch.int64)
    counts = state.counts[rows]
    return state.prompt[rows] | (counts > 0), counts


def _expected(seqs: list[Sequence], pending: torch.Tensor | None):
    """seen and counts from the token lists, each pending token read from `pending`."""
    seen = torch.zeros(len(seqs), VOCAB, dtype=torch.bool)
    counts = torch.zeros(len(seqs), VOCAB, dtype=torch.int32)
    for i, s in enumerate(seqs):
        outputs = list(s.output_token_ids)
        if s.pending_row is not None:
            outputs.append(int(pending[s.pending_row]))
        for t in outputs:
            counts[i, t] += 1
        seen[i, s.token_ids[: s.num_prompt_tokens]] = True
    return seen | (counts > 0), counts


def test_counts_kept_across_steps_equal_rebuilt_counts():
    rng = random.Random(0)
    state = PenaltyCounts(VOCAB, torch.device("cpu"))
    live = [_seq(rng) for _ in range(5)]
    paused: list[Sequence] = []
    pending = None
    first_seen = set()
    for step in range(60):
        # The previous step's samples reach the host (Scheduler.commit), except a sequence's
        # that ended while the step was in flight: its token is dropped.
        for s in live + paused:
            if s.pending_row is not None:
                if rng.random() < 0.05:
                    s.pending_row = None
                    s.status = SequenceStatus.FINISHED
                else:
                    s.token_ids.append(int(pending[s.pending_row]))
                    s.pending_row = None
        live = [s for s in live if not s.is_finished]
        paused = [s for s in paused if not s.is_finished]
        # Sequences finish, join, pause (absent from steps) and come back.
        if rng.random() < 0.15 and live:
            done = live.pop(rng.randrange(len(live)))
            done.status = SequenceStatus.FINISHED
        if rng.random() < 0.25:
            live.append(_seq(rng))
        if rng.random() < 0.1 and live:
            paused.append(live.pop(rng.randrange(len(live))))
        if rng.random() < 0.2 and paused:
            back = paused.pop()
            back.token_ids += [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 4))]
            live.append(back)
        # Synchronous steps append on the host; asynchronous ones leave a pending token.
        sync = rng.random() < 0.3
        for s in live:
            if sync:
                s.token_ids.append(rng.randrange(VOCAB))
        rng.shuffle(live)
        prev = torch.tensor([rng.randrange(VOCAB) for _ in range(len(live) + 3)])
        if not sync:
            for row, s in enumerate(live):
                s.pending_row = row + 2 if row % 2 else row
        pending = prev
        seen, counts = _seen_and_counts(state, live, None if sync else pending)
        want_seen, want_counts = _expected(live, pending)
        assert torch.equal(counts, want_counts), step
        assert torch.equal(seen, want_seen), step
        first_seen |= {s.seq_id for s in live}
        for s in live:
            if s.pending_row is None and not sync:
                raise AssertionError("every live sequence of an asynchronous step is pending")
    # Rows are rebuilt from the lists only at first sight or after a pause that let another
    # sequence take the row: most steps add one token per sequence.
    assert len(first_seen) <= state.num_rebuilt < 2 * len(first_seen)
    assert state.counts.shape[0] <= 16  # finished sequences' rows were reused


def test_distrusted_rows_rebuild():
    state = PenaltyCounts(VOCAB, torch.device("cpu"))
    seq = Sequence([1, 2], SamplingParams(presence_penalty=1.0))
    seq.token_ids += [3, 3]
    seq.pending_row = 0
    pending = torch.tensor([4])
    for _ in range(2):  # the same step penalized twice counts its pending token once
        _, counts = _seen_and_counts(state, [seq], pending)
        assert counts[0, 3] == 2 and counts[0, 4] == 1 and counts.sum() == 3
    # The counted token never reached the host, and the next step has a new pending one at
    # the same position.
    pending = torch.tensor([9, 6])
    seq.pending_row = 1
    _, counts = _seen_and_counts(state, [seq], pending)
    assert counts[0, 3] == 2 and counts[0, 6] == 1 and counts.sum() == 3
    seq.pending_row = None
    seq.token_ids[2:] = [5]  # outputs replaced by a shorter list
    seen, counts = _seen_and_counts(state, [seq])
    assert counts[0].tolist() == [1 if t == 5 else 0 for t in range(VOCAB)]
    assert seen[0, [1, 2, 5]].all() and seen[0].sum() == 3
    assert state.num_rebuilt == 4
