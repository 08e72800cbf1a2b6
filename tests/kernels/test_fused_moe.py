"""The fused MoE kernel against its torch reference (Triton's interpreter without a GPU)."""

from __future__ import annotations

import pytest
import torch

from nanopaged.kernels.fused_moe import fused_moe, fused_moe_ref, moe_align

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter's tl.dot handles fp32 and fp16; bf16 runs on the GPU only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _inputs(num_tokens, num_experts, top_k, hidden, inter, dtype, seed=0, skip_expert=None):
    """Random x, weights scaled so outputs are O(1), and softmax top-k routing."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if skip_expert is not None:
        logits[:, skip_expert] = float("-inf")  # no token picks it
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    to = dict(device=DEVICE, dtype=dtype)
    return x.to(**to), w13.to(**to), w2.to(**to), weights.to(**to), ids.to(DEVICE)


@pytest.mark.parametrize("num_experts, top_k, block_m", [(8, 2, 16), (4, 1, 16), (16, 4, 32)])
@pytest.mark.parametrize("num_tokens", [1, 3, 40])
def test_moe_align_groups_every_slot_once(num_tokens, num_experts, top_k, block_m):
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.rand(num_tokens, num_experts, generator=gen).topk(top_k, dim=-1).indices
    sorted_slots, block_experts = moe_align(ids.to(DEVICE), num_experts, block_m)
    sorted_slots, block_experts = sorted_slots.cpu().long(), block_experts.cpu().long()
    num_slots = num_tokens * top_k
    real = sorted_slots[sorted_slots < num_slots]
    assert sorted(real.tolist()) == list(range(num_slots))
    assert (sorted_slots[sorted_slots >= num_slots] == num_slots).all()
    flat = ids.flatten()
    tiles = sorted_slots.view(-1, block_m)
    for tile, expert in zip(tiles, block_experts.tolist()):
        slots = tile[tile < num_slots]
        if expert == num_experts:  # past the last used tile: nothing but padding
            assert slots.numel() == 0
        else:
            assert slots.numel() > 0 and (flat[slots] == expert).all()
    used = block_experts[block_experts < num_experts]
    assert (used[1:] >= used[:-1]).all()  # tiles in expert order


CASES = [
    # (num_tokens, num_experts, top_k, hidden, inter): hidden and inter off the 64 tiles
    (1, 8, 2, 64, 32),  # one token: most experts get nothing
    (5, 16, 1, 80, 48),  # top-1, fewer tokens than experts
    (37, 8, 2, 96, 40),  # more slots per expert than one 16-row tile
    (70, 4, 3, 64, 72),  # 52 slots per expert: a larger row tile
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "t{}-e{}-k{}-h{}-i{}".format(*c))
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_moe_matches_ref(case, dtype):
    x, w13, w2, weights, ids = _inputs(*case, dtype)
    out = fused_moe(x, w13, w2, weights, ids)
    # The reference in fp32 from the same (rounded) inputs.
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), weights.float(), ids)
    assert out.shape == x.shape and out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_expert_without_tokens_is_skipped():
    x, w13, w2, weights, ids = _inputs(9, 8, 2, 64, 32, torch.float32, skip_expert=3)
    assert not (ids == 3).any()
    w13[3] = float("nan")  # read by nobody, so it cannot leak into the output
    w2[3] = float("nan")
    out = fused_moe(x, w13, w2, weights, ids)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, fused_moe_ref(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_ref_is_the_per_token_sum():
    """The reference itself: each token sums weight * silu(x Wg^T) * (x Wu^T) Wd^T over its k."""
    x, w13, w2, weights, ids = _inputs(6, 4, 2, 16, 8, torch.float64)
    out = fused_moe_ref(x, w13, w2, weights, ids)
    for t in range(6):
        want = torch.zeros(16, dtype=torch.float64, device=DEVICE)
        for w, e in zip(weights[t], ids[t].tolist()):
            gate, up = w13[e, :8] @ x[t], w13[e, 8:] @ x[t]
            want += w * (w2[e] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(out[t], want)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 256, 2048])
def test_fused_moe_real_shape(num_tokens):
    """Qwen3-30B-A3B's experts: 128, top-8, hidden 2048, moe_intermediate 768, bf16."""
    x, w13, w2, weights, ids = _inputs(num_tokens, 128, 8, 2048, 768, torch.bfloat16)
    out = fused_moe(x, w13, w2, weights, ids)
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), weights.float(), ids)
    torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())
