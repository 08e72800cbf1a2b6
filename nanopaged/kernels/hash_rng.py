"""Counter-based uniform noise: u = hash(seed, offset, index), the same bits in Triton and torch.

A row's noise is a pure function of its (seed, offset) and the token index, so a seeded draw
does not depend on the batch around it, and the torch twin reproduces the kernel's numbers bit
for bit (tl.rand's Philox has no torch twin). The mixing is murmur3's 32-bit finalizer, applied
to the key words in a chain and then once to each index, spread by a multiply and keyed by
the row's two words (one round per token: the sampler's last pass computes it for every
token of a row).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # CPU-only installs use uniform_ref
    triton = None

_MASK32 = 0xFFFFFFFF


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    # h * c mod 2**32 in 16-bit halves, so no int64 product overflows.
    lo = h * (c & 0xFFFF)
    hi = ((h * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    # Every input bit flips about half of the output bits.
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _row_keys(seeds: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    seeds, offsets = seeds.long(), offsets.long()
    a = _fmix32((seeds & _MASK32) ^ 0x2545F491)
    a = _fmix32(a ^ ((seeds >> 32) & _MASK32))
    a = _fmix32(a ^ (offsets & _MASK32))
    a = _fmix32(a ^ ((offsets >> 32) & _MASK32))
    return a, _fmix32((a + 0x9E3779B9) & _MASK32)


def uniform_ref(
    seeds: torch.Tensor, offsets: torch.Tensor, vocab: int, start: int = 0
) -> torch.Tensor:
    """u in (0, 1), [batch, vocab] fp32, for int64 seeds/offsets [batch] and the token ids
    start .. start + vocab - 1: the kernel's bits."""
    # int64 tensors hold the uint32 words: torch's uint32 lacks the shifts and products.
    key_a, key_b = _row_keys(seeds.cpu(), offsets.cpu())
    idx = torch.arange(start, start + vocab, dtype=torch.int64)
    h = _fmix32(((_mul32(idx, 0x9E3779B1)[None, :] ^ key_a[:, None]) + key_b[:, None])
                & _MASK32)
    # 23 bits plus a half: exact in fp32 and never 0 or 1, so log(u) and log(-log(u)) are finite.
    return (((h >> 9).float() + 0.5) * 2.0**-23).to(seeds.device)


def gumbel_ref(u: torch.Tensor) -> torch.Tensor:
    """Gumbel noise -log(-log(u)) of uniform u in (0, 1) (the kernels' gumbel, within ~4e-7)."""
    return -torch.log(-torch.log(u))


if triton is not None:
    # The interpreter has no libdevice: there gumbel's logs are numpy's.
    INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

    @triton.jit
    def _fast_log(x):
        # lg2.approx times ln 2: log2's absolute error is ~2^-22, so the result is relatively
        # accurate away from x = 1 only.
        if INTERPRETED:
            return tl.log(x)
        else:
            return libdevice.fast_logf(x)

    @triton.jit
    def scaled(x_raw, inv_temp):
        """x_raw * inv_temp rounded on its own (mul.rn): no FMA may fold it into a sum or
        difference that follows, so every kernel that filters or draws a token computes the
        same bits for it (a fused product differs in the last bit from an unfused one, and
        a near tie or a token at a cut-off could then go the other way)."""
        if INTERPRETED:
            return x_raw * inv_temp
        else:
            return libdevice.mul_rn(x_raw, inv_temp)

    @triton.jit
    def noisy_score(x, u):
        """x + gumbel(u), the sum rounded on its own (add.rn) for the same reason as scaled:
        x from scaled."""
        if INTERPRETED:
            return x + gumbel(u)
        else:
            return libdevice.add_rn(x, gumbel(u))

    @triton.jit
    def gumbel(u):
        """-log(-log(u)) for fp32 u in (0, 1), within ~4e-7 absolute: a compiled logf costs
        ~30 instructions, and two per token made the sampler's noise pass compute-bound.

        e = -log(u) must be accurate relative to itself (the outer log turns a relative error
        into an absolute one): below 1/2 the fast log is, above it e comes from the atanh
        series 2 (s + s^3/3 + ... + s^15/15), s = w / (2 - w) <= 1/3, w = 1 - u (exact)."""
        w = 1.0 - u
        s = w / (2.0 - w)
        s2 = s * s
        series = 1.0 / 15.0
        series = series * s2 + 1.0 / 13.0
        series = series * s2 + 1.0 / 11.0
        series = series * s2 + 1.0 / 9.0
        series = series * s2 + 1.0 / 7.0
        series = series * s2 + 1.0 / 5.0
        series = series * s2 + 1.0 / 3.0
        series = series * s2 + 1.0
        e = tl.where(u < 0.5, -_fast_log(u), 2.0 * s * series)
        return -_fast_log(e)


    @triton.jit
    def _mix(h):
        h ^= h >> 16
        h *= 0x85EBCA6B
        h ^= h >> 13
        h *= 0xC2B2AE35
        h ^= h >> 16
        return h

    @triton.jit
    def row_keys(seed, offset):
        """(key_a, key_b) uint32 of one row's int64 seed and offset."""
        key_a = _mix((seed & 0xFFFFFFFF).to(tl.uint32) ^ 0x2545F491)
        key_a = _mix(key_a ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
        key_a = _mix(key_a ^ (offset & 0xFFFFFFFF).to(tl.uint32))
        key_a = _mix(key_a ^ ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32))
        return key_a, _mix(key_a + 0x9E3779B9)

    @triton.jit
    def uniform(idx, key_a, key_b):
        """fp32 u in (0, 1) for int32 token indices idx, as uniform_ref computes it."""
        h = _mix(((idx.to(tl.uint32) * 0x9E3779B1) ^ key_a) + key_b)
        return ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
