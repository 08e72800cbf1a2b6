"""Sampling over the vocabulary shards of tensor-parallel ranks, without gathering the logits.

Each rank's LM head holds a slice of the vocabulary. When every row of a step samples by
temperature alone (or greedily), the full row's token is the argmax of x + noise over all
tokens (the raw logits for a greedy row), and the noise of a token depends only on its id
(nanopaged.kernels.sampler): so each rank samples its own slice with its ids' noise, and rank
0 takes, per row, the winner of the slice with the largest score (the first slice on ties,
as argmax takes the first maximum). Only a score and a token per row and rank travel, instead
of a [rows, vocab] gather; the result is the token the whole row would give.

Top-k, top-p and min-p cut at thresholds over the whole row, and logprobs, penalties and
min_tokens masks need the whole row too: steps with any of them gather the logits as before
(StepRows.shardable decides).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from nanopaged.layers.backend import backend_for
from nanopaged.sampling.output import DeviceSamples
from nanopaged.sampling.rows import row_stream

if TYPE_CHECKING:
    from nanopaged.distributed.parallel import TensorParallel
    from nanopaged.engine.sequence import Sequence


def settings_array(seqs: list[Sequence]) -> np.ndarray:
    """[3, rows] int64 for the step's wire: temperature (fp32 bits), seed, output position."""
    temps = np.array([s.sampling_params.temperature for s in seqs], dtype=np.float32)
    seeds = np.array([row_stream(s) for s in seqs], dtype=np.int64)
    offsets = np.array([s.num_output_tokens for s in seqs], dtype=np.int64)
    return np.stack([temps.view(np.int32).astype(np.int64), seeds, offsets])


def pick_across_shards(scores: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """scores, token_ids: [shards, rows], each shard's winner in vocabulary order -> [rows]
    token ids: the winner of the shard with the largest score, the first shard on ties."""
    best = scores.argmax(dim=0)  # the first maximum
    return token_ids.gather(0, best[None, :])[0]


def sample_shards(
    local_logits: torch.Tensor, vocab_start: int, settings: np.ndarray, tp: TensorParallel
) -> DeviceSamples | None:
    """Collective: every rank samples its logits [rows, n] (token ids vocab_start.. of the
    vocabulary) by the step's settings (settings_array); rank 0 gets the rows' token ids
    [rows] int64 and the scores they won with (not finite where NaN or infinite logits
    decided the row: a NaN row scores NaN greedily and -inf sampled), the other ranks None."""
    device = local_logits.device
    rows = local_logits.shape[0]
    s = torch.from_numpy(settings).to(device, non_blocking=True)
    temperatures = s[0].to(torch.int32).view(torch.float32)
    zeros = torch.zeros(rows, dtype=torch.int32, device=device)
    ones = torch.ones(rows, dtype=torch.float32, device=device)
    if local_logits.shape[1]:
        out = backend_for(device).sample(
            local_logits, temperatures, zeros, ones, ones - 1, s[1], s[2], 0, vocab_start,
            logprobs=False, plain=True, min_p=False,
        )
        scores, token_ids = out.scores, out.token_ids + vocab_start
    else:  # a rank whose slice is all padding (a vocabulary smaller than the rank count)
        scores = torch.full((rows,), float("-inf"), device=device)
        token_ids = zeros.long()
    # [rows, 2] int64 per rank: the score's bits and the token id; rank 0: [rows, 2 * size]
    packed = torch.stack([scores.view(torch.int32).long(), token_ids], dim=1)
    gathered = tp.gather_last_dim(packed)
    if gathered is None:
        return None
    per_rank = gathered.view(rows, tp.size, 2).transpose(0, 1)  # [size, rows, 2]
    shard_scores = per_rank[..., 0].to(torch.int32).view(torch.float32)  # [size, rows]
    # amax is NaN where a shard's score is, as argmax then picks that shard: the winner's.
    return DeviceSamples(pick_across_shards(shard_scores, per_rank[..., 1]),
                         shard_scores.amax(dim=0))  # fmt: skip
