"""skinny_linear (Triton) against skinny_linear_ref: the interpreter on tiny shapes without a GPU,
bf16 layer shapes on the GPU."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import DEVICE

from nanopaged.kernels.skinny_gemm import (
    SkinnyGemmConfig,
    gdc_wait,
    k_split,
    skinny_linear,
    skinny_linear_ref,
)

# The interpreter's tl.dot handles fp32 and fp16; bf16 runs on the GPU only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# weight [N, K] of Qwen3-0.6B's and Llama-3-8B's projections
QWEN_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]
LLAMA_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def inputs(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0, x_pad: int = 0):
    """x [m, k] (rows strided by k + x_pad), weight [n, k] scaled for O(1) outputs, bias."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k + x_pad, generator=g)[:, :k]
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    to = dict(dtype=dtype, device=DEVICE)
    return x.to(**to), w.to(**to), None if b is None else b.to(**to)


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Within one unit in the last place of ref (the fp32 sums differ only in order, so a
    rounding can land on the neighbour), plus a hair for outputs that cancel to ~0; fp32
    within 1e-5 relative."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, out.shape, ref.shape)
    assert not out.isnan().any()
    eps = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 1e-5}[ref.dtype]
    ref64, diff = ref.double(), (out.double() - ref.double()).abs()
    tol = eps * ref64.abs() + 1e-4 * ref64.abs().max()
    assert (diff <= tol).all(), ((diff - tol).max().item(), diff.max().item())


@pytest.mark.parametrize(
    "k,split_k,block_k,expected",
    [(3072, 2, 1024, (2048, 2)), (3072, 3, 1024, (1024, 3)), (2048, 4, 512, (512, 4)),
     (100, 3, 32, (64, 2)), (14336, 8, 1024, (2048, 7)), (96, 1, 32, (96, 1))],
)
def test_k_split_covers_k_with_whole_chunks(k, split_k, block_k, expected):
    k_per_split, splits = k_split(k, split_k, block_k)
    assert (k_per_split, splits) == expected
    assert k_per_split % block_k == 0 and (splits - 1) * k_per_split < k <= splits * k_per_split


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(
    "m,n,k,cfg",
    [
        (1, 40, 96, SkinnyGemmConfig(block_n=8, block_k=32)),  # N tail, 3 chunks
        (3, 37, 128, SkinnyGemmConfig(block_n=4, block_k=32, split_k=2)),  # odd M and N
        (2, 24, 100, SkinnyGemmConfig(block_n=8, block_k=32, split_k=3)),  # K not a chunk multiple
        (8, 16, 64, SkinnyGemmConfig(block_n=2, block_k=16, split_k=4)),
        (5, 33, 100, SkinnyGemmConfig(block_n=16, block_k=32, split_k=3, use_dot=True)),
        (16, 64, 256, SkinnyGemmConfig(block_n=32, block_k=64, use_dot=True)),
        (11, 48, 64, SkinnyGemmConfig(block_n=16, block_k=16, split_k=4, use_dot=True)),
    ],
)
def test_skinny_linear_small(m, n, k, cfg, bias, dtype):
    x, w, b = inputs(m, n, k, dtype, bias, seed=m * n + k, x_pad=8)
    out = skinny_linear(x, w, b, config=cfg)
    assert_matches(out, skinny_linear_ref(x, w, b))


@pytest.mark.parametrize("dtype", DTYPES)
def test_skinny_linear_small_default_config(dtype):
    for m in (1, 4, 9, 16):
        x, w, b = inputs(m, 72, 160, dtype, bias=True, seed=m)
        assert_matches(skinny_linear(x, w, b), skinny_linear_ref(x, w, b))


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", QWEN_SHAPES)
def test_skinny_linear_qwen_shapes(n, k, bias):
    for m in range(1, 17):
        x, w, b = inputs(m, n, k, torch.bfloat16, bias, seed=m)
        assert_matches(skinny_linear(x, w, b), skinny_linear_ref(x, w, b))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", LLAMA_SHAPES)
def test_skinny_linear_llama_shapes(n, k):
    for m in (1, 2, 3, 4, 8, 13, 16):
        x, w, b = inputs(m, n, k, torch.bfloat16, bias=m == 3, seed=m)
        assert_matches(skinny_linear(x, w, b), skinny_linear_ref(x, w, b))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "cfg",
    [
        SkinnyGemmConfig(block_n=4, block_k=1024, split_k=3, num_warps=4),
        SkinnyGemmConfig(block_n=8, block_k=512, split_k=4, num_warps=2),
        SkinnyGemmConfig(block_n=16, block_k=256, split_k=4, use_dot=True, num_stages=3),
        SkinnyGemmConfig(block_n=64, block_k=128, split_k=2, use_dot=True, num_stages=4),
    ],
)
def test_skinny_linear_configs(cfg):
    """Explicit launches on N = 1000 (not a multiple of any block) and K = 3072."""
    for m in (1, 2, 5, 8, 16):
        x, w, b = inputs(m, 1000, 3072, torch.bfloat16, bias=True, seed=m)
        if cfg.block_n * (1 << (m - 1).bit_length()) > 64 and not cfg.use_dot:
            continue  # more registers than the elementwise tile should take
        assert_matches(skinny_linear(x, w, b, config=cfg), skinny_linear_ref(x, w, b))


@pytest.mark.gpu
def test_split_k_replays_in_a_cuda_graph():
    """Split-K counts reset themselves: replays of one graph give the same bits as eager runs,
    for new x each replay."""
    cfg = SkinnyGemmConfig(block_n=8, block_k=512, split_k=4, num_warps=2)
    x, w, b = inputs(4, 1024, 2048, torch.bfloat16, bias=True)
    eager = skinny_linear(x, w, b, config=cfg)
    assert torch.equal(eager, skinny_linear(x, w, b, config=cfg))  # deterministic order
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        out = skinny_linear(x, w, b, config=cfg)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in range(3):
        x.copy_(inputs(4, 1024, 2048, torch.bfloat16, bias=False, seed=seed + 1)[0])
        graph.replay()
        assert torch.equal(out, skinny_linear(x, w, b, config=cfg))
        assert_matches(out, skinny_linear_ref(x, w, b))



@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4, 16])
def test_pdl_waits_for_the_kernel_that_writes_x(m):
    """Launched as a programmatic dependent, the GEMM starts streaming its weight early but
    reads x only after the kernel before it (here one writing x) has finished: every call in a
    graph of producer -> GEMM pairs sees its own x."""
    if gdc_wait is None:
        pytest.skip("this Triton has no programmatic dependent launch")
    x, w, b = inputs(m, 2048, 3072, torch.bfloat16, bias=True)
    sources = [inputs(m, 1, 3072, torch.bfloat16, bias=False, seed=s + 1)[0] for s in range(6)]
    skinny_linear(x, w, b, pdl=True)  # compiles outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        outs = []
        for src in sources:
            torch.mul(src, 1.0, out=x)  # a kernel (a copy_ would be a memcpy node)
            outs.append(skinny_linear(x, w, b, pdl=True))
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    for src, out in zip(sources, outs):
        assert_matches(out, skinny_linear_ref(src, w, b))
