"""The op tables of a model's layers other than attention: Triton kernels on CUDA; on a CPU
the kernels' torch references (the same functions the kernel tests use as their oracles), and
for bfloat16 models the C kernels of kernels/cpu_native.c where they compiled.

Attention has backends of its own (nanopaged/attention); each names the op table the other
layers compute with, and binding it (AttentionBackend.bind) binds that table to every layer
here that computes (`bind_backend`). A layer built outside a runner computes with the
references, on any device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from nanopaged.kernels import (
    cpu_native,
    fused_moe,
    penalties,
    rms_norm,
    rotary,
    sampler,
    sampler_chunks,
    silu_and_mul,
    skinny_gemm,
)
from nanopaged.layers import cpu_gemm
from nanopaged.platform import platform_of


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x viewed as rows of its last dimension, copied only when a row is not contiguous."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    shape = x.shape
    if residual is None:
        return rms_norm.rms_norm(_rows(x), weight, eps).view(shape)
    out, residual = rms_norm.rms_norm(_rows(x), weight, eps, _rows(residual))
    return out.view(shape), residual.view(shape)


def _silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    # rows: [num_tokens, 2 * d] -> [num_tokens, d]
    return silu_and_mul.silu_and_mul(_rows(x)).view(*x.shape[:-1], x.shape[-1] // 2)


# Decode-sized GEMMs (1 to 16 rows, 16-bit) of CUDA-graph decode steps go to the skinny
# kernel, except 2+ rows on weights this large, where cuBLAS already streams at the copy rate
# (Llama-3-8B's gate_up, 224 MB: 0.94-0.97x). fp32 stays on cuBLAS (exact, the HF parity
# tests), and so do eager steps: there a Triton launch costs more host time than cuBLAS's,
# and small eager steps are bound by the host (bench --sampling's logprobs row lost 15-20%
# with the kernel in every small step, and nothing with it in graph steps only).
_SKINNY_LARGE_WEIGHT = 64 << 20


class CudaLinear:
    """x W^T (+ b) on CUDA: cuBLAS, except the decode GEMMs run while in_graphs (the owner's
    decode graphs warming up and capturing: a replay runs no Python), which take the skinny
    kernel where it wins."""

    def __init__(self) -> None:
        self.in_graphs = False

    @contextlib.contextmanager
    def graphs(self) -> Iterator[None]:
        """in_graphs inside this block."""
        previous, self.in_graphs = self.in_graphs, True
        try:
            yield
        finally:
            self.in_graphs = previous

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: None
    ) -> torch.Tensor:
        # H200, CUDA graphs: the skinny kernel beats cuBLAS at 1 row on every Qwen3-0.6B and
        # Llama-3-8B layer shape (1.1-3.8x) and ties or wins at 2-16 rows
        # (benchmarks/skinny_gemm_bench.py).
        if (
            self.in_graphs
            and x.dim() == 2
            and x.shape[0] <= skinny_gemm.MAX_M
            and x.dtype in (torch.bfloat16, torch.float16)
            and x.stride(1) == 1
            and weight.is_contiguous()
            and (x.shape[0] == 1 or weight.numel() * weight.element_size() < _SKINNY_LARGE_WEIGHT)
        ):
            return skinny_gemm.skinny_linear(x, weight, bias)
        return F.linear(x, weight, bias)


def _rms_norm_native(x, weight, eps, residual=None):
    native = x.dtype in (torch.bfloat16, torch.float32) and weight.dtype == x.dtype
    if not native or (residual is not None and residual.dtype != x.dtype):
        return rms_norm.rms_norm_ref(x, weight, eps, residual)
    return cpu_native.rms_norm(x, weight, eps, residual)


def _silu_and_mul_native(x):
    # fp32 in C (one pass, no chunk views); 16-bit dtypes stay torch's (see CPU_NATIVE)
    if x.dtype != torch.float32:
        return silu_and_mul.silu_and_mul_ref(x)
    return cpu_native.silu_and_mul(x)


def _rotate_native(x, cos_t, signed_sin_t):
    if x.dtype != torch.bfloat16 or x.stride(-1) != 1:
        return rotary.rotate_ref(x, cos_t, signed_sin_t)
    return cpu_native.rotate(x, cos_t, signed_sin_t)


@dataclass(frozen=True)
class Backend:
    """The op table of a model's layers other than attention (whose backends live in
    nanopaged/attention, each naming the op table it runs beside)."""

    name: str
    # (x, weight, bias | None, packed weight | None) -> x W^T (+ b); packed: the CPU's
    # oneDNN copy of the weight (layers/cpu_gemm), None on GPUs
    linear: Callable
    # (x, weight, eps, residual | None) -> out, or (out, x + residual) with a residual
    rms_norm: Callable
    # [..., 2d] -> [..., d]
    silu_and_mul: Callable
    # (x, w13, w2, topk_weights, topk_ids) -> [tokens, hidden]
    fused_moe: Callable
    # (logits, temperatures, top_ks, top_ps, min_ps, seeds, offsets, num_logprobs,
    #  vocab_start, *, logprobs) -> FusedSample
    sample: Callable
    # logits [batch, vocab] -> logits.argmax(dim=-1) (int64 [batch])
    argmax: Callable
    # (logits fp32, rows, state_rows, counts, prompt, penalties [3, n]): penalties in place,
    # see kernels/penalties.penalize_rows_ref
    penalize_rows: Callable = penalties.penalize_rows_ref
    # The rotary layer's rotation (the Triton attention backend runs fused rotary kernels
    # instead): (x [tokens, heads, dim], cos_t, signed_sin_t) -> rotated x, see
    # kernels/rotary.rotate_ref
    rotate: Callable = rotary.rotate_ref


TORCH = Backend(
    name="torch",
    linear=cpu_gemm.linear,
    rms_norm=rms_norm.rms_norm_ref,
    silu_and_mul=silu_and_mul.silu_and_mul_ref,
    fused_moe=fused_moe.fused_moe_ref,
    sample=sampler.sample_ref,
    argmax=sampler.argmax_ref,
)

TRITON = Backend(
    name="triton",
    linear=CudaLinear(),
    rms_norm=_rms_norm_triton,
    silu_and_mul=_silu_and_mul_triton,
    fused_moe=fused_moe.fused_moe,
    sample=sampler_chunks.sample_fused,
    argmax=sampler_chunks.argmax_fused,
    penalize_rows=penalties.penalize_rows,
)


def triton_ops() -> Backend:
    """TRITON with a linear of its own: its graph switch (CudaLinear.in_graphs) belongs to
    the one runner that binds this table."""
    return replace(TRITON, linear=CudaLinear())


# Models on a CPU where kernels/cpu_native.c compiled: its kernels for the norms, rotary (bf16),
# and fp32's SiLU and one-row GEMMs; the rest as TORCH.
CPU_NATIVE = Backend(
    name="cpu-native",
    linear=cpu_gemm.native_linear,
    rms_norm=_rms_norm_native,
    # bf16 SiLU stays torch's: its vectorized exp beat a C loop there (bound by arithmetic)
    silu_and_mul=_silu_and_mul_native,
    fused_moe=fused_moe.fused_moe_ref,
    sample=sampler.sample_ref,
    argmax=sampler.argmax_ref,
    rotate=_rotate_native,
)


def backend_for(device: torch.device | str) -> Backend:
    """The op table for tensors on device outside a model (the sampler's logits): Triton
    kernels on a GPU, else the torch references. A model's table comes with its attention
    backend (nanopaged.attention.attention_backend, by device and dtype)."""
    return TRITON if platform_of(device).gpu else TORCH


class UsesBackend:
    """A layer that computes through a Backend: the references until one is bound."""

    backend: Backend = TORCH


def bind_backend(model: nn.Module, backend: Backend) -> None:
    """Give every layer of model that computes through a backend this one."""
    for module in model.modules():
        if isinstance(module, UsesBackend):
            module.backend = backend
