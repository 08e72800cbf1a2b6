"""The sparse mixture-of-experts block (Qwen2-MoE / Qwen3-MoE) that replaces a dense MLP.

Under tensor parallelism every rank holds every expert's share of the intermediate dimension
(and of the shared expert's), so each rank's output is a partial sum: the routed experts and
the shared expert are added first and all-reduced once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanopaged.distributed.parallel import TensorParallel
from nanopaged.layers.activation import SiluAndMul
from nanopaged.layers.backend import UsesBackend
from nanopaged.layers.linear import (
    SINGLE,
    Linear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    _shard,
    default_weight_loader,
)

# A checkpoint's per-expert projection -> (our stacked parameter, part of it).
EXPERT_PARAMS = {
    "gate_proj": ("w13", "gate"),
    "up_proj": ("w13", "up"),
    "down_proj": ("w2", "down"),
}


class MoEExperts(UsesBackend, nn.Module):
    """num_experts SiLU-gated MLPs stacked: w13 [E, 2 * I/tp, H] ([gate_r; up_r] per expert)
    and w2 [E, H, I/tp]; forward returns this rank's partial sum, not yet reduced."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.local_size = tp.shard(intermediate_size)
        self.tp = tp
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * self.local_size, hidden_size), requires_grad=False
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden_size, self.local_size), requires_grad=False
        )
        for param, parts in ((self.w13, ("gate", "up")), (self.w2, ("down",))):
            param.weight_loader = self.weight_loader
            # Every checkpoint tensor this parameter must receive: the loader checks them off.
            param.shard_ids = [(e, part) for e in range(num_experts) for part in parts]

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]
    ) -> None:
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is outside [0, {self.num_experts})")
        size, start = self.local_size, self.tp.rank * self.local_size
        if part == "down":
            # loaded: [hidden, intermediate]; this rank keeps its columns
            dst = param.data[expert]
            full = (dst.shape[0], size * self.tp.size)
            default_weight_loader(dst, _shard(loaded, full, 1, start, size))
            return
        # loaded: [intermediate, hidden]; gate rows go first, up rows after them
        dst = param.data[expert].narrow(0, 0 if part == "gate" else size, size)
        full = (size * self.tp.size, dst.shape[1])
        default_weight_loader(dst, _shard(loaded, full, 0, start, size))

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return self.backend.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids)


class SharedExpert(nn.Module):
    """Qwen2-MoE's always-on expert: a dense SiLU MLP whose output stays a partial sum."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallel) -> None:
        super().__init__()
        size = intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [size, size], [0, 1], tp=tp)
        self.down_proj = RowParallelLinear(size, hidden_size, tp=tp, reduce_results=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Router softmax -> top-k experts (optionally renormalised) -> weighted expert sum,
    plus a sigmoid-gated shared expert when shared_expert_size > 0."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        norm_topk_prob: bool,
        shared_expert_size: int = 0,
        tp: TensorParallel = SINGLE,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        self.reduce_results = reduce_results  # False: the caller sums the ranks' parts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.tp = tp
        self.gate = Linear(hidden_size, num_experts)  # the router, whole on every rank
        self.experts = MoEExperts(num_experts, hidden_size, intermediate_size, tp)
        if shared_expert_size:
            self.shared_expert = SharedExpert(hidden_size, shared_expert_size, tp)
            self.shared_expert_gate = Linear(hidden_size, 1)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, hidden]; probs: [num_tokens, num_experts] in fp32
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        # topk_weights, topk_ids: [num_tokens, top_k]
        topk_weights, topk_ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        out = self.experts(x, topk_weights.to(x.dtype), topk_ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out) if self.reduce_results else out
