"""The MoE block: routing, stacked expert loading, and tensor-parallel shards, without processes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanopaged.distributed.parallel import TensorParallel
from nanopaged.layers.moe import SparseMoeBlock

HIDDEN, NUM_EXPERTS, TOP_K, INTER, SHARED = 16, 6, 2, 8, 12


class PartialSums(TensorParallel):
    """A rank whose all-reduce is left to the test: it returns its partial sum."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    """One MoE layer's tensors under their Hugging Face names (relative to `mlp.`)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * 0.5

    ckpt = {"gate.weight": rand(NUM_EXPERTS, HIDDEN)}
    for e in range(NUM_EXPERTS):
        ckpt[f"experts.{e}.gate_proj.weight"] = rand(INTER, HIDDEN)
        ckpt[f"experts.{e}.up_proj.weight"] = rand(INTER, HIDDEN)
        ckpt[f"experts.{e}.down_proj.weight"] = rand(HIDDEN, INTER)
    ckpt["shared_expert.gate_proj.weight"] = rand(SHARED, HIDDEN)
    ckpt["shared_expert.up_proj.weight"] = rand(SHARED, HIDDEN)
    ckpt["shared_expert.down_proj.weight"] = rand(HIDDEN, SHARED)
    ckpt["shared_expert_gate.weight"] = rand(1, HIDDEN)
    return ckpt


def _block(tp: TensorParallel, norm: bool, shared: bool) -> SparseMoeBlock:
    """A block built in float64, loaded through its parameters' weight_loaders."""
    torch.set_default_dtype(torch.float64)
    try:
        block = SparseMoeBlock(HIDDEN, NUM_EXPERTS, TOP_K, INTER, norm, SHARED * shared, tp)
    finally:
        torch.set_default_dtype(torch.float32)
    params = dict(block.named_parameters())
    packed = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    parts = {"gate_proj": ("w13", "gate"), "up_proj": ("w13", "up"), "down_proj": ("w2", "down")}
    for name, w in _checkpoint().items():
        if not shared and name.startswith("shared_expert"):
            continue
        pieces = name.split(".")
        if pieces[0] == "experts":
            param_name, part = parts[pieces[2]]
            p = params[f"experts.{param_name}"]
            p.weight_loader(p, w, (int(pieces[1]), part))
        elif pieces[-2] in packed:
            packed_name, sid = packed[pieces[-2]]
            p = params[name.replace(pieces[-2], packed_name)]
            p.weight_loader(p, w, sid)
        else:
            p = params[name]
            p.weight_loader(p, w)
    return block


def _expected(x: torch.Tensor, norm: bool, shared: bool) -> torch.Tensor:
    """HF's formula, token by token (its router softmax runs in fp32 whatever the dtype)."""
    ckpt = _checkpoint()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = F.softmax(ckpt["gate.weight"] @ x[t], dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(TOP_K)
        if norm:
            weights = weights / weights.sum()
        weights = weights.double()
        for w, e in zip(weights, ids.tolist()):
            g = ckpt[f"experts.{e}.gate_proj.weight"] @ x[t]
            u = ckpt[f"experts.{e}.up_proj.weight"] @ x[t]
            out[t] += w * (ckpt[f"experts.{e}.down_proj.weight"] @ (F.silu(g) * u))
        if shared:
            g = ckpt["shared_expert.gate_proj.weight"] @ x[t]
            u = ckpt["shared_expert.up_proj.weight"] @ x[t]
            s = ckpt["shared_expert.down_proj.weight"] @ (F.silu(g) * u)
            out[t] += torch.sigmoid(ckpt["shared_expert_gate.weight"] @ x[t]) * s
    return out


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("norm", [False, True])
def test_block_is_hf_formula(norm, shared):
    x = torch.randn(7, HIDDEN, dtype=torch.float64)
    block = _block(TensorParallel(), norm, shared)
    torch.testing.assert_close(block(x), _expected(x, norm, shared))


@pytest.mark.parametrize("size", [2, 4])
def test_tp_partial_sums_add_up(size):
    """Each rank holds its slice of every expert's intermediate dimension; the partial
    outputs of all ranks sum to the single-rank output (what the one all-reduce does)."""
    x = torch.randn(5, HIDDEN, dtype=torch.float64)
    whole = _block(TensorParallel(), True, True)
    ranks = [_block(PartialSums(rank=r, size=size), True, True) for r in range(size)]
    local = INTER // size
    for r, block in enumerate(ranks):
        assert block.experts.w13.shape == (NUM_EXPERTS, 2 * local, HIDDEN)
        assert block.experts.w2.shape == (NUM_EXPERTS, HIDDEN, local)
        rows = slice(r * local, (r + 1) * local)
        assert torch.equal(block.experts.w13[:, :local], whole.experts.w13[:, rows])
        assert torch.equal(block.experts.w13[:, local:], whole.experts.w13[:, INTER:][:, rows])
        assert torch.equal(block.experts.w2, whole.experts.w2[:, :, rows])
    total = sum(block(x) for block in ranks)
    torch.testing.assert_close(total, whole(x))


def test_expert_loader_refuses_bad_tensors():
    block = _block(TensorParallel(), False, False)
    w13 = block.experts.w13
    with pytest.raises(ValueError, match=r"expert 6 is outside \[0, 6\)"):
        w13.weight_loader(w13, torch.zeros(INTER, HIDDEN), (6, "gate"))
    with pytest.raises(ValueError, match="does not fit"):
        w13.weight_loader(w13, torch.zeros(INTER + 1, HIDDEN), (0, "up"))
    assert len(w13.shard_ids) == 2 * NUM_EXPERTS and len(block.experts.w2.shard_ids) == NUM_EXPERTS
