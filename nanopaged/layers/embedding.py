"""Token embedding and the LM head (which may share its weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanopaged.layers.linear import default_weight_loader


class VocabEmbedding(nn.Module):
    """Token id -> hidden vector."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(VocabEmbedding):
    """Hidden vector -> vocabulary logits."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)
