"""Token embedding and the LM head (which may share its weight), split over the vocabulary.

With tensor parallelism each rank holds ceil(vocab / tp) rows; the last rank's rows past the
vocabulary are zero padding, so any vocabulary size works.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanopaged.distributed.parallel import TensorParallel
from nanopaged.layers.backend import UsesBackend
from nanopaged.layers.linear import SINGLE


class VocabEmbedding(nn.Module):
    """Token id -> hidden vector; each rank looks up its rows and the ranks sum."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp
        self.rows_per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.rows_per_rank
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_rank, hidden_size), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape != (self.vocab_size, param.shape[1]):
            raise ValueError(
                f"weight shape {tuple(loaded.shape)} does not fit "
                f"{(self.vocab_size, param.shape[1])}"
            )
        rows = max(0, min(self.rows_per_rank, self.vocab_size - self.vocab_start))
        param.data[:rows].copy_(loaded[self.vocab_start : self.vocab_start + rows])
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.rows_per_rank)
        # hidden: [num_tokens, hidden_size], zero where another rank holds the token
        hidden = F.embedding(local * mine, self.weight) * mine.unsqueeze(-1)
        return self.tp.all_reduce(hidden)


class LMHead(UsesBackend, VocabEmbedding):
    """Hidden vector -> vocabulary logits; rank 0 gathers the ranks' slices, others get None."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__(vocab_size, hidden_size, tp)
        # CPU bf16: the weight prepacked for oneDNN (see layers/cpu_gemm.pack_model).
        self.packed_weight: torch.Tensor | None = None

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's logits [rows, n] of the token ids vocab_start .. vocab_start + n - 1 it
        holds (its padding rows left out); every rank, no collective."""
        logits = self.backend.linear(hidden, self.weight, None, self.packed_weight)
        return logits[:, : max(0, min(self.rows_per_rank, self.vocab_size - self.vocab_start))]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.backend.linear(hidden, self.weight, None, self.packed_weight)
        if self.tp.size == 1:
            return logits
        # logits: [rows, rows_per_rank] per rank -> [rows, vocab_size] on rank 0
        full = self.tp.gather_last_dim(logits)
        return None if full is None else full[:, : self.vocab_size]
