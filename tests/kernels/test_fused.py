"""rms_norm, apply_rotary/qk_norm_rotary and silu_and_mul (Triton) against their torch refs."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import DEVICE

from nanopaged.kernels.rms_norm import rms_norm, rms_norm_ref
from nanopaged.kernels.rotary import apply_rotary, qk_norm_rotary, qk_norm_rotary_ref, rotary_ref
from nanopaged.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref
from nanopaged.kernels.store_kv import store_kv_ref
from nanopaged.layers.rotary import RotaryEmbedding

CPU_DTYPES = [torch.float32, torch.float16]
ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-6


def rand(*shape, dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def packed_view(num_rows: int, width: int, dtype, seed: int, offset: int = 40) -> torch.Tensor:
    """A [num_rows, width] view into a wider tensor: row stride != width, unaligned start."""
    return rand(num_rows, width + offset + 24, dtype=dtype, seed=seed)[:, offset : offset + width]


def assert_matches(
    out: torch.Tensor, ref: torch.Tensor, ulps: int = 2, frac: float = 0.01, floor: float = 0.0
) -> None:
    """Within `ulps` units in the last place of |ref| + floor, differing at all in at most a
    fraction `frac` of the elements (16-bit only): a 1-ulp fp32 difference in rstd (another
    summation order) flips a rare rounding. fp32 allows 32 ulps (~4e-6) anywhere."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, out.shape, ref.shape)
    assert not out.isnan().any()
    info = torch.finfo(out.dtype)
    if out.dtype == torch.float32:
        ulps, frac = max(ulps, 32), 1.0
    tol = ulps * info.eps * (ref.double().abs() + floor) + info.tiny
    diff = (out.double() - ref.double()).abs()
    assert (diff <= tol).all(), ((diff - tol).max(), diff.max())
    assert (diff > 0).double().mean().item() <= frac, (diff > 0).double().mean()


# ---------------------------------------------------------------- rms_norm


def run_rms_norm(num_rows, hidden, dtype, residual: bool, strided: bool, seed: int = 0):
    if strided:
        x = packed_view(num_rows, hidden, dtype, seed)
        res = packed_view(num_rows, hidden, dtype, seed + 1, offset=8) if residual else None
    else:
        x = rand(num_rows, hidden, dtype=dtype, seed=seed, scale=3.0)
        res = rand(num_rows, hidden, dtype=dtype, seed=seed + 1) if residual else None
    weight = rand(hidden, dtype=dtype, seed=seed + 2).abs() + 0.5
    x_before = x.clone()
    out = rms_norm(x, weight, EPS, res)
    ref = rms_norm_ref(x, weight, EPS, res)
    assert torch.equal(x, x_before)
    if residual:
        (out, new_res), (ref, ref_res) = out, ref
        assert torch.equal(new_res, ref_res)  # one rounded add: bit-exact
    assert_matches(out, ref)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(
    "num_rows,hidden,residual,strided",
    [
        (3, 576, False, False),
        (2, 1024, True, False),
        (2, 3072, True, True),
        (37, 128, False, True),  # q heads as rows: several rows per program, a partial tail
        (21, 64, True, False),
        (5, 100, False, True),  # neither a power of two nor a multiple of 16
    ],
)
def test_rms_norm(num_rows, hidden, dtype, residual, strided):
    run_rms_norm(num_rows, hidden, dtype, residual, strided)


def test_rms_norm_empty_and_fp32_weight():
    x = torch.empty(0, 64, device=DEVICE)
    assert rms_norm(x, torch.ones(64, device=DEVICE), EPS).shape == (0, 64)
    # An fp32 weight over fp16 x promotes the output to fp32, as torch does.
    x = rand(4, 64, dtype=torch.float16, seed=3)
    weight = rand(64, dtype=torch.float32, seed=4)
    out = rms_norm(x, weight, EPS)
    assert out.dtype == torch.float32
    assert_matches(out, rms_norm_ref(x, weight, EPS))


# ---------------------------------------------------------------- rotary

MAX_POSITION = 4096


def tables(head_dim: int, max_position: int = MAX_POSITION) -> tuple[torch.Tensor, torch.Tensor]:
    rope = RotaryEmbedding(head_dim, max_position, base=1_000_000.0)
    return rope.cos.to(DEVICE), rope.sin.to(DEVICE)


def packed_qk(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed):
    """q, k as strided views of one packed qkv projection output (v after them, untouched)."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = rand(num_tokens, q_size + 2 * kv_size, dtype=dtype, seed=seed, scale=2.0)
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    return qkv, q, k


def run_rotary(num_tokens, num_heads, num_kv_heads, head_dim, dtype, norm: bool, seed=0,
               positions_dtype=torch.int64, exact: bool = False):
    cos, sin = tables(head_dim)
    qkv, q, k = packed_qk(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed)
    g = torch.Generator().manual_seed(seed)
    positions = torch.randperm(MAX_POSITION, generator=g)[:num_tokens].to(positions_dtype)
    positions = positions.to(DEVICE)
    qkv_before = qkv.clone()
    if norm:
        q_weight = rand(head_dim, dtype=dtype, seed=seed + 1).abs() + 0.5
        k_weight = rand(head_dim, dtype=dtype, seed=seed + 2).abs() + 0.5
        args = (q, k, q_weight, k_weight, EPS, cos, sin, positions)
        (q_out, k_out), (q_ref, k_ref) = qk_norm_rotary(*args), qk_norm_rotary_ref(*args)
    else:
        args = (q, k, cos, sin, positions)
        (q_out, k_out), (q_ref, k_ref) = apply_rotary(*args), rotary_ref(*args)
    assert torch.equal(qkv, qkv_before), "inputs must not be modified"
    assert q_out.is_contiguous() and k_out.is_contiguous()
    if exact:
        # Rotation alone mirrors torch's roundings (cast tables, round products, round sum).
        assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    else:
        # x1 * cos - x2 * sin can cancel, so an ulp of the inputs (the norm's rstd may differ
        # from torch's by an fp32 ulp) is measured against the largest output, not this one.
        for out, ref in ((q_out, q_ref), (k_out, k_ref)):
            assert_matches(out, ref, ulps=4, floor=ref.float().abs().max().item())


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize(
    "num_tokens,num_heads,num_kv_heads,head_dim",
    [(7, 4, 2, 128), (5, 3, 1, 64), (40, 2, 2, 64)],
)
def test_rotary(num_tokens, num_heads, num_kv_heads, head_dim, dtype, norm):
    # The interpreter has no FMA and the same fp32 ops as torch: rotation alone is bit-exact.
    run_rotary(num_tokens, num_heads, num_kv_heads, head_dim, dtype, norm, exact=not norm)


def test_rotary_int32_positions_and_empty():
    run_rotary(6, 2, 1, 64, torch.float32, norm=True, positions_dtype=torch.int32)
    cos, sin = tables(64, 16)
    q = torch.empty(0, 2, 64, device=DEVICE)
    k = torch.empty(0, 1, 64, device=DEVICE)
    positions = torch.empty(0, dtype=torch.int64, device=DEVICE)
    q_out, k_out = apply_rotary(q, k, cos, sin, positions)
    assert q_out.shape == q.shape and k_out.shape == k.shape


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("norm", [False, True])
def test_rotary_stores_kv_into_the_cache(dtype, norm):
    # With a store, the rotary kernel also writes the rotated k and v where store_kv_ref
    # would (slot -1 skipped), and returns the same q and k as without it.
    num_tokens, num_heads, num_kv_heads, head_dim = 9, 4, 2, 64
    cos, sin = tables(head_dim)
    qkv, q, k = packed_qk(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed=3)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.arange(num_tokens, device=DEVICE) * 7
    caches = [rand(5, 4, num_kv_heads, head_dim, dtype=dtype, seed=s) for s in (4, 5)]
    slots = torch.randperm(20, generator=torch.Generator().manual_seed(6))[:num_tokens]
    slots[[2, 5]] = -1
    slots = slots.to(DEVICE)
    expected = [c.clone() for c in caches]
    if norm:
        weights = [rand(head_dim, dtype=dtype, seed=s).abs() + 0.5 for s in (7, 8)]
        plain = qk_norm_rotary(q, k, *weights, EPS, cos, sin, positions)
        fused = qk_norm_rotary(q, k, *weights, EPS, cos, sin, positions, (v, *caches, slots))
    else:
        plain = apply_rotary(q, k, cos, sin, positions)
        fused = apply_rotary(q, k, cos, sin, positions, (v, *caches, slots))
    assert torch.equal(fused[0], plain[0]) and torch.equal(fused[1], plain[1])
    store_kv_ref(plain[1], v, *expected, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


# ---------------------------------------------------------------- silu_and_mul


def run_silu_and_mul(num_tokens, d, dtype, strided: bool, seed=0):
    if strided:
        x = packed_view(num_tokens, 2 * d, dtype, seed)
    else:
        x = rand(num_tokens, 2 * d, dtype=dtype, seed=seed, scale=3.0)
    out = silu_and_mul(x)
    assert out.shape == (num_tokens, d) and out.is_contiguous()
    assert_matches(out, silu_and_mul_ref(x))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize(
    "num_tokens,d,strided", [(3, 3072, False), (5, 96, True), (9, 1024, True), (2, 1500, False)]
)
def test_silu_and_mul(num_tokens, d, dtype, strided):
    run_silu_and_mul(num_tokens, d, dtype, strided)


# ---------------------------------------------------------------- GPU: bf16, real shapes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_fused_gpu(dtype):
    for hidden in (576, 1024, 3072):
        run_rms_norm(3000, hidden, dtype, residual=True, strided=False, seed=hidden)
        run_rms_norm(257, hidden, dtype, residual=True, strided=True, seed=hidden)
        run_rms_norm(256, hidden, dtype, residual=False, strided=True, seed=hidden)
    for head_dim in (64, 128):
        run_rms_norm(4096 * 16, head_dim, dtype, residual=False, strided=True)
    for num_heads, num_kv_heads, head_dim in ((16, 8, 128), (14, 2, 64)):
        for norm in (False, True):
            run_rotary(4096, num_heads, num_kv_heads, head_dim, dtype, norm)
    run_rotary(256, 32, 8, 128, dtype, True, seed=1, positions_dtype=torch.int32)
    for d in (3072, 1408):
        run_silu_and_mul(4096, d, dtype, strided=False)
        run_silu_and_mul(256, d, dtype, strided=True)


@pytest.mark.gpu
def test_launchers_capture_in_cuda_graph():
    """No host sync in any launcher: all three replay from one captured graph."""
    dtype = torch.bfloat16
    cos, sin = tables(128)
    x = rand(256, 1024, dtype=dtype, seed=0)
    res = rand(256, 1024, dtype=dtype, seed=1)
    w = rand(1024, dtype=dtype, seed=2)
    gate_up = rand(256, 2 * 3072, dtype=dtype, seed=3)
    _, q, k = packed_qk(256, 16, 8, 128, dtype, seed=4)
    qw, kw = rand(128, dtype=dtype, seed=5), rand(128, dtype=dtype, seed=6)
    positions = torch.randperm(MAX_POSITION, device="cuda")[:256]

    def step():
        return (
            rms_norm(x, w, EPS, res),
            qk_norm_rotary(q, k, qw, kw, EPS, cos, sin, positions),
            silu_and_mul(gate_up),
        )

    expected = step()  # also compiles every kernel before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    flat = lambda t: [y for z in t for y in (z if isinstance(z, tuple) else (z,))]  # noqa: E731
    for a, b in zip(flat(captured), flat(expected)):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layers_gpu(dtype):
    """The layers' Triton backend (kernels) against their torch backend on the same data."""
    from nanopaged.attention import TorchAttention, TritonAttention
    from nanopaged.layers.activation import SiluAndMul
    from nanopaged.layers.backend import TORCH, TRITON, bind_backend
    from nanopaged.layers.norm import RMSNorm

    def on_gpu(*modules):
        for m in modules:
            assert m.backend is TORCH  # built outside a runner: the references
            bind_backend(m.to("cuda"), TRITON)

    norm = RMSNorm(1024, EPS).to(dtype)
    norm.weight.data = rand(1024, dtype=dtype, seed=5).cpu()
    x, res = rand(300, 1024, dtype=dtype, seed=6).cpu(), rand(300, 1024, dtype=dtype, seed=7).cpu()
    out_cpu, res_cpu = norm(x, res)
    on_gpu(norm)
    out_gpu, res_gpu = norm(x.cuda(), res.cuda())
    assert torch.equal(res_gpu.cpu(), res_cpu)
    assert_matches(out_gpu.cpu(), out_cpu)

    gate_up = rand(300, 2 * 3072, dtype=dtype, seed=8).cpu()
    act = SiluAndMul()
    expected_act = act(gate_up)
    on_gpu(act)
    assert_matches(act(gate_up.cuda()).cpu(), expected_act, frac=1.0)

    rope = RotaryEmbedding(128, MAX_POSITION, 1_000_000.0)
    q_norm, k_norm = RMSNorm(128, EPS).to(dtype), RMSNorm(128, EPS).to(dtype)
    q_norm.weight.data = rand(128, dtype=dtype, seed=9).cpu()
    k_norm.weight.data = rand(128, dtype=dtype, seed=10).cpu()
    _, q, k = packed_qk(300, 16, 8, 128, dtype, seed=11)
    q, k = q.cpu(), k.cpu()
    positions = torch.randperm(MAX_POSITION)[:300]
    # The attention backends' rotations: the layers' (TorchAttention) against the kernels'.
    expected = TorchAttention.rotate(positions, q, k, rope, q_norm, k_norm)
    expected += TorchAttention.rotate(positions, q, k, rope)
    on_gpu(rope, q_norm, k_norm)
    q, k, positions = q.cuda(), k.cuda(), positions.cuda()
    got = TritonAttention.rotate(positions, q, k, rope, q_norm, k_norm)
    got += TritonAttention.rotate(positions, q, k, rope)
    for out, ref in zip(got, expected):
        # CPU and GPU torch sum in different orders: the norm's rstd may differ by an ulp.
        assert_matches(out.cpu(), ref, ulps=4, floor=ref.float().abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_rotary_bit_exact_gpu(dtype):
    """Last, so a failure here does not hide the rest under -x: with FMA contraction off, the
    rotation rounds exactly where torch does, so it equals the torch module bit for bit."""
    for num_heads, num_kv_heads, head_dim in ((16, 8, 128), (14, 2, 64)):
        run_rotary(2048, num_heads, num_kv_heads, head_dim, dtype, norm=False, exact=True)
