"""One step's host arrays: all a rank needs to run the forward pass, packed for the wire."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from nanopaged.platform import to_device

if TYPE_CHECKING:
    from nanopaged.distributed.parallel import TensorParallel
    from nanopaged.engine.scheduler import ScheduledBatch

# num_tokens, batch, table width, logits rows, swap outs, swap ins, copies, pending, shard rows,
# prompt rows
_HEADER = 10


@dataclass
class StepInputs:
    """A step as plain arrays; every tensor-parallel rank runs the same one.

    Block ops are (src, dst) block pairs run before the forward pass; pending_dst are the input
    positions whose ids come from the previous step's samples on the device (rows pending_src).
    sample_settings, when it has columns (one per logits row), says the ranks sample their
    vocabulary shards themselves (nanopaged.sampling.sharded). prompt_rows are the
    rows of the hidden states whose logits score the prompt token in prompt_targets, with the
    top prompt_topk logprobs (prompt_logprobs): every rank runs their logits, in the same
    chunks (nanopaged.sampling.prompt_logprobs).
    """

    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slots: np.ndarray  # [num_tokens] int64
    tables: np.ndarray  # [batch, max_blocks] int32
    context_lens: np.ndarray  # [batch] int32
    cu_seqlens_q: np.ndarray  # [batch + 1] int32
    logits_indices: np.ndarray  # [num_sampled] int64, rows of the hidden states to sample
    blocks_to_swap_out: list[tuple[int, int]]
    blocks_to_swap_in: list[tuple[int, int]]
    blocks_to_copy: list[tuple[int, int]]
    pending_dst: np.ndarray  # [num_pending] int64
    pending_src: np.ndarray  # [num_pending] int64
    # [3, num_sampled or 0] int64: temperature bits, seed, output position (settings_array)
    sample_settings: np.ndarray = field(default_factory=lambda: np.zeros((3, 0), np.int64))
    prompt_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [num_prompt]
    prompt_targets: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    prompt_topk: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @property
    def samples_sharded(self) -> bool:
        return self.sample_settings.shape[1] > 0

    def pack(self) -> np.ndarray:
        """One int64 buffer: a header of sizes, then every array flattened."""
        ops = (self.blocks_to_swap_out, self.blocks_to_swap_in, self.blocks_to_copy)
        pairs = [np.asarray(p, dtype=np.int64).reshape(-1, 2) for p in ops]
        header = np.array(
            [len(self.input_ids), len(self.context_lens), self.tables.shape[1],
             len(self.logits_indices), *(len(p) for p in pairs), len(self.pending_dst),
             self.sample_settings.shape[1], len(self.prompt_rows)],
            dtype=np.int64,
        )  # fmt: skip
        parts = [header, self.input_ids, self.positions, self.slots, self.tables.ravel(),
                 self.context_lens, self.cu_seqlens_q, self.logits_indices, *pairs,
                 self.pending_dst, self.pending_src, self.sample_settings, self.prompt_rows,
                 self.prompt_targets, self.prompt_topk]  # fmt: skip
        return np.concatenate([np.asarray(p, dtype=np.int64).ravel() for p in parts])

    @classmethod
    def unpack(cls, buf: np.ndarray) -> StepInputs:
        """The inverse of pack."""
        tokens, batch, width, rows, n_out, n_in, n_copy, n_pending, n_shard, n_prompt = (
            buf[:_HEADER].tolist()
        )
        at = _HEADER

        def take(n: int, dtype=np.int64) -> np.ndarray:
            nonlocal at
            out = buf[at : at + n].astype(dtype)
            at += n
            return out

        def pairs(n: int) -> list[tuple[int, int]]:
            return [tuple(p) for p in take(2 * n).reshape(-1, 2).tolist()]

        return cls(
            input_ids=take(tokens),
            positions=take(tokens),
            slots=take(tokens),
            tables=take(batch * width, np.int32).reshape(batch, width),
            context_lens=take(batch, np.int32),
            cu_seqlens_q=take(batch + 1, np.int32),
            logits_indices=take(rows),
            blocks_to_swap_out=pairs(n_out),
            blocks_to_swap_in=pairs(n_in),
            blocks_to_copy=pairs(n_copy),
            pending_dst=take(n_pending),
            pending_src=take(n_pending),
            sample_settings=take(3 * n_shard).reshape(3, n_shard),
            prompt_rows=take(n_prompt),
            prompt_targets=take(n_prompt),
            prompt_topk=take(n_prompt),
        )


def is_arange(a: np.ndarray, n: int) -> bool:
    """Whether a is [0, 1, ..., n - 1]."""
    if len(a) != n:
        return False
    return n == 0 or (a[0] == 0 and a[-1] == n - 1 and bool((a == np.arange(n)).all()))


def build_step_inputs(
    batch: ScheduledBatch, host: dict[str, np.ndarray], sample_settings: np.ndarray | None
) -> StepInputs:
    """A batch's StepInputs: its input ids (0 where a sample is still on the device; a
    speculating row's drafts after its last token), the host arrays of its positions and slots
    (host, from the attention metadata's builder), its sampled rows (every position of a row
    with drafts), block ops, pending samples and prompt rows."""
    seqs = batch.seqs
    drafts = batch.draft_token_ids
    input_ids: list[int] = []
    for i, (seq, n) in enumerate(zip(seqs, batch.num_scheduled_tokens)):
        start = seq.num_computed_tokens
        if drafts and drafts[i]:
            assert seq.pending_row is None, "drafts follow a known last token"
            input_ids.extend(seq.token_ids[start:])
            input_ids.extend(drafts[i])
            continue
        input_ids.extend(seq.token_ids[start : start + n])
        if start + n > len(seq.token_ids):
            input_ids.append(0)  # a sample still on the device, copied in there
    cu = host["cu_seqlens_q"]
    sampling_rows = [i for i, x in enumerate(batch.sampling) if x]
    logits_indices = (cu[1:] - 1)[sampling_rows].astype(np.int64)
    if drafts:
        logits_indices = _verified_rows(batch, sampling_rows, cu)
    # (input position, row of the previous step's samples) of each pending sample
    pending = np.asarray([(int(cu[i + 1]) - 1, s.pending_row) for i, s in enumerate(seqs)
                          if s.pending_row is not None], dtype=np.int64).reshape(-1, 2)  # fmt: skip
    extra = {} if sample_settings is None else dict(sample_settings=sample_settings)
    if batch.prompt_logprob_spans:
        extra.update(_prompt_rows(batch, cu))
    return StepInputs(
        input_ids=np.asarray(input_ids, dtype=np.int64),
        positions=host["positions"],
        slots=host["slots"],
        tables=host["tables"],
        context_lens=host["context_lens"],
        cu_seqlens_q=cu,
        logits_indices=logits_indices,
        blocks_to_swap_out=batch.blocks_to_swap_out,
        blocks_to_swap_in=batch.blocks_to_swap_in,
        blocks_to_copy=batch.blocks_to_copy,
        pending_dst=pending[:, 0].copy(),
        pending_src=pending[:, 1].copy(),
        **extra,
    )


def as_decode_rows(step: StepInputs) -> StepInputs:
    """The same step with each input token as a one-token decode row of its own: its context
    ends at its position, its block table is its sequence's. A step whose rows hold only
    cached context and their new tokens (a speculating step's last token and drafts) then runs
    as a decode step, e.g. replayed from a decode graph: every token's K/V is stored before
    any row attends, and each row reads only the positions up to its own."""
    q_lens = np.diff(step.cu_seqlens_q)
    n = len(step.input_ids)
    return replace(
        step,
        tables=np.repeat(step.tables, q_lens, axis=0),
        context_lens=(step.positions + 1).astype(np.int32),
        cu_seqlens_q=np.arange(n + 1, dtype=np.int32),
    )


def _verified_rows(
    batch: ScheduledBatch, sampling_rows: list[int], cu_seqlens_q: np.ndarray
) -> np.ndarray:
    """The logits rows of a step with drafts: each sampled row's last 1 + d positions (its
    last token, then its d drafts), rows in order."""
    ends = cu_seqlens_q[1:].astype(np.int64)[sampling_rows]
    counts = np.asarray([batch.num_drafts(i) + 1 for i in sampling_rows], dtype=np.int64)
    firsts = np.repeat(ends - counts, counts)
    return firsts + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def _prompt_rows(batch: ScheduledBatch, cu_seqlens_q: np.ndarray) -> dict[str, np.ndarray]:
    """StepInputs' prompt rows, from the batch's prompt_logprob_spans: the step's input rows
    of those positions, the prompt tokens they predict, the top-k each asked for."""
    rows, targets, topk = [], [], []
    for i, first, end in batch.prompt_logprob_spans:
        seq = batch.seqs[i]
        at = int(cu_seqlens_q[i]) + first - seq.num_computed_tokens
        rows.append(np.arange(at, at + end - first, dtype=np.int64))
        targets.append(np.asarray(seq.token_ids[first + 1 : end + 1], dtype=np.int64))
        topk.append(np.full(end - first, seq.sampling_params.prompt_logprobs, np.int64))
    return dict(prompt_rows=np.concatenate(rows), prompt_targets=np.concatenate(targets),
                prompt_topk=np.concatenate(topk))  # fmt: skip


def pending_ids(
    step: StepInputs, prev_tokens: torch.Tensor | None, tp: TensorParallel, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """(input positions, token ids) on the device for the step's pending samples, if any, from
    the previous step's sampled tokens (rank 0's; the other ranks get them broadcast, on the
    device). Positions are None when every input id is pending and comes from the same row of
    the previous step's samples (a steady decode): the ids are then a view of those samples,
    with no index arrays to copy and no gather."""
    n = len(step.pending_dst)
    if not n:
        return None
    if tp.rank == 0:
        assert prev_tokens is not None, "pending samples need the previous step's tokens"
    steady = n == len(step.input_ids) and is_arange(step.pending_dst, n)
    if steady and is_arange(step.pending_src, n):
        values = prev_tokens[:n] if tp.rank == 0 else torch.empty(n, dtype=torch.long,
                                                                   device=device)  # fmt: skip
        return None, tp.broadcast(values)
    dst = to_device(step.pending_dst, device)
    if tp.rank == 0:
        values = prev_tokens.index_select(0, to_device(step.pending_src, device))
    else:
        values = torch.empty(n, dtype=torch.long, device=device)
    return dst, tp.broadcast(values)


def host_arrays(
    num_scheduled: list[int], starts: list[int], tables: np.ndarray, block_size: int
) -> dict[str, np.ndarray]:
    """The step's positions, slots and lengths, built in bulk on the host.

    tables: [batch, max_blocks] int32 block tables.
    """
    bs = block_size
    batch = len(num_scheduled)
    q_lens = np.asarray(num_scheduled, dtype=np.int64)
    starts_np = np.asarray(starts, dtype=np.int64)
    cu = np.zeros(batch + 1, dtype=np.int32)
    np.cumsum(q_lens, out=cu[1:])
    if int(cu[-1]) == batch:  # decode: one token per sequence
        seq_idx, pos = np.arange(batch), starts_np
    else:
        seq_idx = np.repeat(np.arange(batch), q_lens)
        pos = np.arange(cu[-1]) - np.repeat(cu[:-1].astype(np.int64) - starts_np, q_lens)
    slots = tables[seq_idx, pos // bs].astype(np.int64) * bs + pos % bs
    return dict(
        positions=pos,
        slots=slots,
        tables=tables,
        context_lens=(starts_np + q_lens).astype(np.int32),
        cu_seqlens_q=cu,
    )


class Peers(Protocol):
    """The other tensor-parallel ranks as rank 0's runner drives them (distributed/workers)."""

    alive: bool
    before_leave: Callable[[], object] | None

    def publish(self, step: StepInputs) -> None: ...
    def step_done(self) -> None: ...
    def zero_blocks(self, block_ids: list[int]) -> None: ...
    def allocate_swap_space(self, num_blocks: int) -> None: ...
