"""Mixture-of-experts FFN over routed tokens: silu(x W_gate^T) * (x W_up^T) W_down^T per expert.

The Triton path groups each token's k (token, expert) pairs — its slots — by expert, pads every
expert's run of slots to a multiple of BLOCK_M, and runs two grouped GEMMs whose row tiles each
belong to one expert: gate_up with SiLU-and-mul in its epilogue, then down scaled by the
routing weight. The k results of a token are summed last, so nothing is added atomically and
the result does not depend on scheduling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nanopaged.kernels.paged_decode import dot_precision

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use fused_moe_ref
    triton = None


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Torch reference, a loop over the experts that were hit.

    x [num_tokens, hidden]; w13 [num_experts, 2 * inter, hidden] (gate rows, then up rows);
    w2 [num_experts, hidden, inter]; topk_weights, topk_ids [num_tokens, top_k] -> [num_tokens,
    hidden] = sum over a token's k experts of weight * expert(x).
    """
    out = torch.zeros_like(x)
    num_experts = w13.shape[0]
    # hit: [num_experts, top_k, num_tokens], True where a token's j-th choice is that expert
    hit = F.one_hot(topk_ids.long(), num_experts).permute(2, 1, 0).bool()
    for e in hit.flatten(1).any(1).nonzero().flatten().tolist():
        k_idx, tokens = torch.where(hit[e])
        gate, up = F.linear(x[tokens], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        out.index_add_(0, tokens, y * topk_weights[tokens, k_idx, None].to(y.dtype))
    return out


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots grouped by expert, each expert's run padded to a multiple of block_m.

    Returns sorted_slots [max_padded] (slot = token * top_k + j; padding holds num_slots) and
    block_experts [max_padded // block_m] (the expert of each row tile; num_experts past the
    last used tile). Sizes depend only on the input's shape and nothing syncs with the host,
    so this runs inside a CUDA graph.
    """
    flat = topk_ids.flatten().long()
    num_slots = flat.numel()
    max_padded = num_slots + num_experts * (block_m - 1)
    max_padded = -(-max_padded // block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(num_slots, device=flat.device) - start[expert_of]
    sorted_slots = torch.full((max_padded,), num_slots, dtype=torch.int32, device=flat.device)
    sorted_slots[padded_start[expert_of] + rank] = order.to(torch.int32)
    tile_start = torch.arange(0, max_padded, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_end, tile_start, right=True).to(torch.int32)
    return sorted_slots, block_experts


if triton is not None:

    @triton.jit
    def _gate_up_kernel(
        x_ptr, w_ptr, act_ptr, sorted_ptr, experts_ptr,
        num_slots, num_experts, hidden, inter,
        stride_xt, stride_we, stride_wn, stride_as,
        TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        # Grid: (row tiles, cdiv(inter, BLOCK_N)); a tile's BLOCK_M slots share one expert.
        tile = tl.program_id(0)
        expert = tl.load(experts_ptr + tile).to(tl.int64)
        if expert >= num_experts:
            return
        slots = tl.load(sorted_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = slots < num_slots
        tokens = (slots // TOP_K).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < inter
        ks = tl.arange(0, BLOCK_K)
        w = w_ptr + expert * stride_we
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k_ok = k0 + ks < hidden
            # a: [BLOCK_M, BLOCK_K] rows of x; b_*: [BLOCK_K, BLOCK_N] of W_gate^T / W_up^T
            a = tl.load(x_ptr + tokens[:, None] * stride_xt + (k0 + ks)[None, :],
                        mask=valid[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
            b_mask = k_ok[:, None] & col_ok[None, :]
            b_gate = tl.load(w + cols[None, :] * stride_wn + (k0 + ks)[:, None],
                             mask=b_mask, other=0.0)  # fmt: skip
            b_up = tl.load(w + (inter + cols)[None, :] * stride_wn + (k0 + ks)[:, None],
                           mask=b_mask, other=0.0)  # fmt: skip
            gate = tl.dot(a, b_gate, gate, input_precision=DOT_PRECISION)
            up = tl.dot(a, b_up, up, input_precision=DOT_PRECISION)
        act = gate / (1.0 + tl.exp(-gate)) * up
        out = act_ptr + slots.to(tl.int64)[:, None] * stride_as + cols[None, :]
        tl.store(out, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])

    @triton.jit
    def _down_kernel(
        act_ptr, w_ptr, out_ptr, weights_ptr, sorted_ptr, experts_ptr,
        num_slots, num_experts, hidden, inter,
        stride_as, stride_we, stride_wn, stride_os,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        # Grid: (row tiles, cdiv(hidden, BLOCK_N)); out[slot] = weight[slot] * act[slot] W2^T.
        tile = tl.program_id(0)
        expert = tl.load(experts_ptr + tile).to(tl.int64)
        if expert >= num_experts:
            return
        slots = tl.load(sorted_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = slots < num_slots
        rows = slots.to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < hidden
        ks = tl.arange(0, BLOCK_K)
        w = w_ptr + expert * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k_ok = k0 + ks < inter
            a = tl.load(act_ptr + rows[:, None] * stride_as + (k0 + ks)[None, :],
                        mask=valid[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
            b = tl.load(w + cols[None, :] * stride_wn + (k0 + ks)[:, None],
                        mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        scale = tl.load(weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)
        acc = acc * scale[:, None]
        out = out_ptr + rows[:, None] * stride_os + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


def tile_config(num_slots: int, num_experts: int) -> dict:
    """Launch settings by how many slots an expert gets on average: decode batches give a few
    each, so row tiles stay small (each expert's weights read about once); with fewer slots
    than experts only a few experts run, so narrower column tiles give more programs."""
    per_expert = num_slots / num_experts
    block_m = 16 if per_expert <= 8 else 32 if per_expert <= 32 else 64
    block_n = 32 if num_slots < num_experts else 64
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, num_warps=4, num_stages=3)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: dict | None = None,
) -> torch.Tensor:
    """Same contract as fused_moe_ref, in two grouped Triton GEMMs; config overrides
    tile_config's launch settings (benchmarks sweep it)."""
    assert triton is not None, "fused_moe needs triton; use fused_moe_ref"
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    assert w13.shape == (num_experts, 2 * inter, hidden), (w13.shape, x.shape)
    assert w2.shape == (num_experts, hidden, inter), (w2.shape, w13.shape)
    assert topk_ids.shape == topk_weights.shape == (num_tokens, top_k)
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    assert x.dtype == w13.dtype == w2.dtype, (x.dtype, w13.dtype, w2.dtype)
    num_slots = num_tokens * top_k
    if num_slots == 0:
        return torch.zeros_like(x)
    cfg = config or tile_config(num_slots, num_experts)
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    sorted_slots, block_experts = moe_align(topk_ids, num_experts, block_m)
    weights = topk_weights.reshape(-1).contiguous()
    # act: [num_slots, inter]; slot_out: [num_slots, hidden], one row per (token, choice)
    act = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    slot_out = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    num_tiles = block_experts.numel()
    precision = dot_precision(x.dtype)
    _gate_up_kernel[(num_tiles, triton.cdiv(inter, block_n))](
        x, w13, act, sorted_slots, block_experts,
        num_slots, num_experts, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=precision, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    _down_kernel[(num_tiles, triton.cdiv(hidden, block_n))](
        act, w2, slot_out, weights, sorted_slots, block_experts,
        num_slots, num_experts, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), slot_out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    # [num_tokens, top_k, hidden] -> [num_tokens, hidden], accumulated in fp32 by torch
    return slot_out.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
