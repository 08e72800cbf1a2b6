"""Prompt logprobs from a prefill step's own logits rows.

A request with prompt_logprobs has, in each of its prefill steps, the hidden-state rows of its
scheduled prompt positions that predict prompt tokens 1..n-1 scored here, after the step's
forward pass: their logits in bounded chunks of rows, turned on the device into the top-k
logprobs, the prompt token's own logprob and its 1-based rank. Under tensor parallelism every
rank runs the same chunks (compute_logits gathers the vocabulary shards on rank 0), and only
rank 0 keeps the results.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from nanopaged.platform import platform_of

if TYPE_CHECKING:
    from nanopaged.outputs import RawLogprobs

# One chunk's [rows, vocab + topk] fp32 block stays within this; a chunk's other temporaries
# (the logits as computed, the log-softmax, the comparison for ranks) are a few times it.
CHUNK_BYTES = 64 << 20
# The top-k the memory profile scores a chunk with (the chunk's rows shrink as k grows, so
# its bytes hardly depend on k).
PROFILE_TOPK = 20


def rows_per_chunk(vocab_size: int, topk: int) -> int:
    """Rows scored at a time: every rank derives the same count from the step's inputs."""
    return max(1, CHUNK_BYTES // (4 * (vocab_size + topk)))


class PromptScores:
    """A step's prompt-row results on their way to the host: filled chunk by chunk by
    score_prompt_rows (asynchronous copies into page-locked buffers on CUDA), then read once."""

    def __init__(self, num_rows: int, topk: int, targets: np.ndarray, widths: np.ndarray,
                 pinned: bool) -> None:  # fmt: skip
        def empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, pin_memory=pinned)

        self.logprobs = empty(num_rows, dtype=torch.float32)  # the prompt token's own
        self.ranks = empty(num_rows, dtype=torch.int64)
        self.top_logprobs = empty(num_rows, topk, dtype=torch.float32)
        self.top_token_ids = empty(num_rows, topk, dtype=torch.int64)
        self.targets = targets
        self.widths = widths
        self.event: torch.cuda.Event | None = None
        self._rows: PromptLogprobRows | None = None

    def rows(self) -> PromptLogprobRows:
        """The results as host arrays, waiting for the device's copies if needed."""
        if self._rows is None:
            if self.event is not None:
                self.event.synchronize()
            # Copies: page-locked buffers go back to their pool.
            self._rows = PromptLogprobRows(
                self.targets,
                self.logprobs.numpy().copy(),
                self.ranks.numpy().copy(),
                self.top_logprobs.numpy().copy(),
                self.top_token_ids.numpy().copy(),
                self.widths,
            )
        return self._rows


def score_prompt_rows(
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
    hidden: torch.Tensor,
    rows: np.ndarray,
    targets: np.ndarray,
    widths: np.ndarray,
    vocab_size: int,
) -> PromptScores | None:
    """Score hidden's `rows` (each predicting the prompt token in `targets`) with the top
    max(widths) logprobs, in chunks of rows_per_chunk; every rank calls this with the same
    arrays, so each makes the same collective calls. Returns rank 0's results (None on other
    ranks, or without rows).

    hidden: [num_tokens, hidden_size]; rows, targets, widths: [num_rows] int64.
    """
    num_rows = len(rows)
    if not num_rows:
        return None
    topk = min(int(widths.max()), vocab_size)
    dev = hidden.device
    gpu = platform_of(dev).gpu
    rows_dev = torch.from_numpy(rows).to(dev, non_blocking=True)
    targets_dev = torch.from_numpy(targets).to(dev, non_blocking=True)
    chunk = rows_per_chunk(vocab_size, topk)
    out: PromptScores | None = None
    for start in range(0, num_rows, chunk):
        end = min(start + chunk, num_rows)
        logits = compute_logits(hidden.index_select(0, rows_dev[start:end]))
        if logits is None:  # a rank other than 0: it took part in the gather, keeps nothing
            continue
        if out is None:
            out = PromptScores(num_rows, topk, targets, widths, pinned=gpu)
        # lp: [end - start, vocab] fp32; row r predicts targets[start + r]
        lp = logits.float().log_softmax(dim=-1)
        del logits
        own = lp.gather(1, targets_dev[start:end, None])  # [end - start, 1]
        out.logprobs[start:end].copy_(own[:, 0], non_blocking=True)
        out.ranks[start:end].copy_((lp > own).sum(dim=-1).add_(1), non_blocking=True)
        if topk:
            top_v, top_i = lp.topk(topk, dim=-1)
            out.top_logprobs[start:end].copy_(top_v, non_blocking=True)
            out.top_token_ids[start:end].copy_(top_i, non_blocking=True)
        del lp
    if out is not None and gpu:
        out.event = torch.cuda.Event()
        out.event.record()
    return out


class PromptLogprobRows:
    """A step's prompt logprobs on the host, shared by the positions of every sequence it
    scored: each records (this, its row) per prompt position (Sequence.prompt_logprobs), and
    a row's dict is made only when an output reads it (see LazyLogprobs)."""

    __slots__ = ("targets", "logprobs", "ranks", "top_logprobs", "top_token_ids", "widths")

    def __init__(
        self,
        targets: np.ndarray,
        logprobs: np.ndarray,
        ranks: np.ndarray,
        top_logprobs: np.ndarray,
        top_token_ids: np.ndarray,
        widths: np.ndarray,
    ) -> None:
        """targets: [rows] the prompt tokens the rows predict; logprobs: [rows] fp32, their
        logprobs; ranks: [rows], their 1-based ranks; top_logprobs: [rows, k] fp32 and
        top_token_ids: [rows, k], each row's top-k best first; widths: [rows], the k each row's
        request asked for."""
        self.targets = targets
        self.logprobs = logprobs
        self.ranks = ranks
        self.top_logprobs = top_logprobs
        self.top_token_ids = top_token_ids
        self.widths = widths

    def __len__(self) -> int:
        return len(self.targets)

    def position(self, row: int) -> RawLogprobs:
        """Row's top-k (its width of them, ranked 1..width) plus the prompt token, which keeps
        its place and rank in the top-k if it is there, else comes last with its own rank."""
        width = self.widths.item(row)
        tokens = self.top_token_ids[row, :width].tolist()
        logprobs = self.top_logprobs[row, :width].tolist()
        ranks: list[int | None] = list(range(1, len(tokens) + 1))
        token = self.targets.item(row)
        if token in tokens:
            logprobs[tokens.index(token)] = self.logprobs.item(row)
        else:
            tokens.append(token)
            logprobs.append(self.logprobs.item(row))
            ranks.append(self.ranks.item(row))
        return tokens, logprobs, ranks
