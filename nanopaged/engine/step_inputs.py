"""One step's host arrays: all a rank needs to run the forward pass, packed for the wire."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# num_tokens, batch, table width, logits rows, swap outs, swap ins, copies, pending, shard rows,
# prompt rows
_HEADER = 10


@dataclass
class StepInputs:
    """A step as plain arrays; every tensor-parallel rank runs the same one.

    Block ops are (src, dst) block pairs run before the forward pass; pending_dst are the input
    positions whose ids come from the previous step's samples on the device (rows pending_src).
    sample_settings, when it has columns (one per logits row), says the ranks sample their
    vocabulary shards themselves (nanopaged.distributed.sharded_sampling). prompt_rows are the
    rows of the hidden states whose logits score the prompt token in prompt_targets, with the
    top prompt_topk logprobs (prompt_logprobs): every rank runs their logits, in the same
    chunks (nanopaged.engine.prompt_logprobs).
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
