"""w4a16_gemm (Triton; the tensor-core and the GEMV kernel) against w4a16_gemm_ref over GPTQ
packings (symmetric or not, desc_act, v1 zeros, one group) and AWQ weights repacked into it,
row counts, K splits (fused or by sum_splits) and ragged tiles; dequantize_int4 against the
weights the test's own packers wrote; the AWQ repack against AWQ's own dequantization."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import DEVICE
from quant_formats import AWQ_ORDER_MAP, quantize_awq, quantize_gptq

from nanopaged.kernels import w4a16_gemm as w4a16
from nanopaged.kernels.w4a16_gemm import (
    M_GEMV,
    Int4Weight,
    W4A16Config,
    default_config,
    dequantize,
    dequantize_int4,
    sum_splits,
    w4a16_gemm,
    w4a16_gemm_ref,
)
from nanopaged.quantization.awq import repack_awq

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def make_weight(kind: str, n: int, k: int, group: int, seed: int = 0):
    """(Int4Weight, the dequantized [n, k] weight the packer meant) of a random weight."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5
    if kind == "awq":  # repacked as the AWQ layer does after loading
        t, deq = quantize_awq(w, group)
        qweight, qzeros = repack_awq(t["qweight"], t["qzeros"])
        return Int4Weight(qweight, t["scales"], qzeros, group), deq
    sym, desc_act, v1 = kind == "gptq-sym", kind == "gptq-desc_act", kind != "gptq-v2"
    t, deq = quantize_gptq(w, group, sym, desc_act, v1=v1, seed=seed)
    zeros = None if sym else t["qzeros"]  # symmetric: the kernel's constant 8
    g_idx = t["g_idx"] if desc_act else None
    return Int4Weight(t["qweight"], t["scales"], zeros, group, g_idx, int(v1)), deq


def to_device(w: Int4Weight) -> Int4Weight:
    move = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return Int4Weight(move(w.qweight), move(w.scales), move(w.qzeros), w.group_size,
                      move(w.g_idx), w.zero_offset)  # fmt: skip


# The kernels see one layout: a repacked AWQ weight is an asymmetric one with zero_offset 0,
# as gptq-v2 is, so "awq" joins only a few tests (odd tiles, dtypes, GPU shapes).
KINDS = ["gptq-sym", "gptq-asym", "gptq-desc_act", "gptq-v2"]


@pytest.mark.parametrize("kind", ["awq"] + KINDS)
def test_dequantize_matches_the_packed_weights(kind):
    w, deq = make_weight(kind, 48, 128, 32)
    assert torch.equal(dequantize_int4(w, torch.float32), deq.t())


def awq_dequantize(qweight, qzeros, scales, group: int) -> torch.Tensor:
    """[K, N] fp32 from AWQ's own packing: column 8 c + AWQ_ORDER_MAP[i] at nibble i of pack c."""
    nibble_of = [AWQ_ORDER_MAP.index(j) for j in range(8)]
    shifts = 4 * torch.tensor(nibble_of, dtype=torch.int32).repeat(qweight.shape[1])  # [N]
    q = (qweight.repeat_interleave(8, dim=1) >> shifts) & 0xF
    zeros = (qzeros.repeat_interleave(8, dim=1) >> shifts) & 0xF
    g = torch.arange(qweight.shape[0]) // group
    return (q - zeros[g]).float() * scales[g].float()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_awq_repack_dequantizes_exactly(group):
    """Random AWQ tensors (every int32 bit pattern, N = 72: an odd count of packs) repacked into
    the kernels' layout on the test device dequantize to exactly AWQ's own dequantization."""
    k, n = 384, 72
    gen = torch.Generator().manual_seed(group)
    words = lambda *shape: torch.randint(-(1 << 31), 1 << 31, shape, generator=gen,  # noqa: E731
                                         dtype=torch.int64).int()  # fmt: skip
    qweight, qzeros = words(k, n // 8), words(k // group, n // 8)
    scales = torch.rand(k // group, n, generator=gen).half()
    packed_w, packed_z = (t.cpu() for t in repack_awq(qweight.to(DEVICE), qzeros.to(DEVICE)))
    assert packed_w.shape == (k // 8, n) and packed_z.shape == qzeros.shape
    assert packed_w.dtype == packed_z.dtype == torch.int32
    w = Int4Weight(packed_w, scales, packed_z, group)
    assert torch.equal(dequantize_int4(w, torch.float32),
                       awq_dequantize(qweight, qzeros, scales, group))  # fmt: skip


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = 1e-5 if out.dtype == torch.float32 else 2e-2
    scale = ref.float().abs().max().clamp(min=1)
    assert ((out.float() - ref.float()).abs().max() / scale).item() <= tol


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m, config",
    [
        (1, W4A16Config(16, 32, 32)),
        (5, W4A16Config(16, 64, 64, split_k=2)),
        (17, W4A16Config(16, 32, 32, split_k=3)),  # a short last split, two row tiles
        (33, W4A16Config(32, 64, 32)),
    ],
)
def test_kernel_matches_reference(kind, dtype, m, config):
    # n = 80: a ragged last tile of output columns
    w, _ = make_weight(kind, 80, 256, 64, seed=m)
    w = to_device(w)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    out = w4a16_gemm(x, w, config)
    assert_close(out, w4a16_gemm_ref(x, w))


@pytest.mark.parametrize("kind", ["gptq-sym", "gptq-asym", "gptq-desc_act"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 3, 16, 33, 256])
def test_groups_and_rows_with_default_config(kind, group, m):
    """The launcher's own tiles over group sizes and row counts (K = 384: three groups of 128,
    twelve of 32; n = 72: nine packs, a ragged last tile)."""
    w, _ = make_weight(kind, 72, 384, group, seed=group + m)
    w = to_device(w)
    x = torch.randn(m, 384, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    config = default_config(m, 72, 384, group, num_sms=8)
    assert group % config.block_k == 0
    assert_close(w4a16_gemm(x, w, config), w4a16_gemm_ref(x, w))


@pytest.mark.parametrize("kind", ["awq", "gptq-asym"])
@pytest.mark.parametrize(
    "config",
    [
        W4A16Config(16, 16, 16, split_k=5),  # five splits of a ragged K, one pack a tile
        W4A16Config(16, 128, 32, split_k=2),  # a tile wider than the weight
        W4A16Config(32, 32, 64, split_k=1, num_warps=2),
    ],
    ids=str,
)
def test_odd_tiles(kind, config):
    w, _ = make_weight(kind, 24, 320, 64, seed=7)
    w = to_device(w)
    x = torch.randn(3, 320, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    assert_close(w4a16_gemm(x, w, config), w4a16_gemm_ref(x, w))


def test_sum_splits_in_order():
    """The split reduction adds partials in split order, then rounds once to the dtype."""
    parts = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    parts[1] *= 1e4
    for dtype in (torch.float32, torch.float16):
        out = sum_splits(parts, dtype)
        ref = ((parts[0] + parts[1]) + parts[2]).to(dtype)
        assert out.dtype == dtype and torch.equal(out, ref)


GEMV_KINDS = KINDS + ["gptq-desc_act-sym"]


def make_gemv_weight(kind: str, n: int, k: int, group: int, seed: int) -> Int4Weight:
    if kind == "gptq-desc_act-sym":  # desc_act without zeros: g_idx with the constant 8
        w, _ = make_weight("gptq-desc_act", n, k, group, seed)
        return to_device(Int4Weight(w.qweight, w.scales, None, group, w.g_idx, 0))
    return to_device(make_weight(kind, n, k, group, seed)[0])


@pytest.mark.parametrize("kind", GEMV_KINDS)
@pytest.mark.parametrize(
    "m, config, group",
    [
        (1, W4A16Config(1, 64, 32, gemv=True), 32),  # one pass over K, no split
        (1, W4A16Config(1, 64, 32, gemv=True), 128),  # four K steps a group
        (2, W4A16Config(2, 32, 16, split_k=3, gemv=True), 64),  # fused sum, a short last split
        (3, W4A16Config(4, 32, 32, split_k=2, fused_sum=False, gemv=True), 32),  # sum_splits
        (3, W4A16Config(4, 32, 32, split_k=2, fused_sum=False, gemv=True), 128),
        (8, W4A16Config(8, 128, 64, split_k=2, gemv=True), 64),  # a tile wider than the weight
    ],
    ids=str,
)
def test_gemv_matches_reference(kind, m, config, group):
    """The GEMV kernel over layouts, zeros, desc_act, v1 zeros, groups, rows and K splits (n =
    40: five packs, ragged tiles; K = 256: two groups of 128, eight of 32)."""
    if config.block_k > group:
        config = W4A16Config(config.block_m, config.block_n, group, config.split_k, gemv=True,
                             fused_sum=config.fused_sum)  # fmt: skip
    w = make_gemv_weight(kind, 40, 256, group, seed=group + m)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(DEVICE, torch.float16)
    assert_close(w4a16_gemm(x, w, config), w4a16_gemm_ref(x, w))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["awq", "gptq-asym"])
def test_gemv_dtypes(kind, dtype):
    """fp32 (exact to 1e-5: the in-register nibbles and scale powers of two are exact), fp16,
    and bf16 where the device runs it."""
    w = make_gemv_weight(kind, 40, 192, 64, seed=3)
    x = torch.randn(3, 192, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    out = w4a16_gemm(x, w, W4A16Config(4, 16, 32, split_k=2, gemv=True))
    assert_close(out, w4a16_gemm_ref(x, w))


def test_gemv_fused_sum_resets_its_counters():
    """The last split of each column block resets its counter: the next launch sums right."""
    from nanopaged.kernels.w4a16_gemm import split_counters

    w = make_gemv_weight("gptq-asym", 64, 256, 64, seed=5)
    config = W4A16Config(2, 16, 32, split_k=4, gemv=True)
    for seed in (0, 1):
        x = torch.randn(2, 256, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
        assert_close(w4a16_gemm(x, w, config), w4a16_gemm_ref(x, w))
        assert int(split_counters(x.device).abs().sum()) == 0


def test_default_config_gemv_up_to_m_gemv():
    """Decode rows up to M_GEMV get the GEMV kernel, with one row tile for all rows."""
    for m in range(1, 17):
        config = default_config(m, 4096, 4096, 128, num_sms=132)
        assert config.gemv == (m <= M_GEMV)
        assert not config.gemv or config.block_m >= m


def test_default_config_splits_k_for_few_rows():
    """Decode rows split K until about three waves of programs; many rows never split."""
    one = default_config(1, 4096, 4096, 128, num_sms=132)
    assert one.split_k >= 2 and 4096 % one.block_k == 0
    assert default_config(256, 4096, 4096, 128, num_sms=132).split_k == 1
    assert default_config(1, 64, 64, 32).block_k == 32


def test_one_group_and_default_config():
    """group_size = K (GPTQ's -1) and the launcher's own choice of tiles."""
    w, _ = make_weight("gptq-asym", 64, 128, 128)
    w = to_device(w)
    x = torch.randn(3, 128).to(DEVICE)
    assert 128 % default_config(3, 64, 128, 128).block_k == 0
    assert_close(w4a16_gemm(x, w), w4a16_gemm_ref(x, w))
    assert w4a16_gemm(x[:0], w).shape == (0, 64)


@pytest.mark.parametrize("kind", ["awq"] + KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_kernel_equals_dequantize_int4(kind, dtype):
    # n = 200, k = 352: ragged last tiles both ways (the kernel's tiles are 64 x 128)
    w = to_device(make_weight(kind, 200, 352, 32, seed=3)[0])
    assert torch.equal(dequantize(w, dtype), dequantize_int4(w, dtype))


@pytest.mark.parametrize("kind", ["awq", "gptq-asym", "gptq-desc_act"])
def test_from_dequant_rows_the_weight_is_dequantized_once(kind, monkeypatch):
    # At DEQUANT_ROWS rows and more the default launch multiplies by the dequantized weight;
    # below them (or with a config) it runs the kernels on the packed one.
    monkeypatch.setattr(w4a16, "DEQUANT_ROWS", 24)
    calls = []
    monkeypatch.setattr(
        w4a16, "dequantize", lambda w, dtype: calls.append(1) or dequantize(w, dtype)
    )
    w = to_device(make_weight(kind, 80, 256, 64, seed=5)[0])
    for m, taken in ((24, True), (40, True), (23, False)):
        calls.clear()
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).to(DEVICE)
        assert_close(w4a16_gemm(x, w), w4a16_gemm_ref(x, w))
        assert bool(calls) == taken, m
    x = torch.randn(40, 256).to(DEVICE)
    calls.clear()
    assert_close(w4a16_gemm(x, w, W4A16Config(32, 64, 32)), w4a16_gemm_ref(x, w))
    assert not calls


def test_strided_rows():
    """x rows with a stride (a view into a wider tensor) are read in place."""
    w, _ = make_weight("gptq-asym", 32, 64, 32)
    w = to_device(w)
    wide = torch.randn(4, 96).to(DEVICE)
    x = wide[:, :64]
    assert_close(w4a16_gemm(x, w, W4A16Config(16, 32, 32)), w4a16_gemm_ref(x.contiguous(), w))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["awq", "gptq-sym", "gptq-desc_act"])
@pytest.mark.parametrize("m", [1, 4, 8, 16, 256])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 12288)])
def test_kernel_gpu_shapes(kind, m, n, k):
    w, _ = make_weight(kind, n, k, 128)
    w = to_device(w)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    assert_close(w4a16_gemm(x, w), w4a16_gemm_ref(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["awq", "gptq-sym"])
def test_paired_gemv_at_one_row(kind, dtype):
    """One row of 16-bit x takes the GEMV kernel's paired path (inline assembly) by default and
    equals the reference; activations of 20,000 (whose products with a nibble pass fp16's
    largest value unless x is scaled first) stay finite in fp16."""
    from nanopaged.kernels.w4a16_gemm import paired_gemv

    w = to_device(make_weight(kind, 2048, 1024, 128, seed=7)[0])
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(7))
    x[0, ::61] = 20000.0
    x = x.to(DEVICE, dtype)
    assert default_config(1, 2048, 1024, 128).gemv and paired_gemv(x, w)
    out = w4a16_gemm(x, w)
    assert torch.isfinite(out).all()
    assert_close(out, w4a16_gemm_ref(x, w))
