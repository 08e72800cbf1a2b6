"""Where the layers' ops run, chosen once per model: Triton kernels on CUDA, their torch
references elsewhere (the same functions the kernel tests use as their oracles).

The ModelRunner picks the backend for its device and binds it to every layer that computes
(`bind_backend`); a layer built outside a runner computes with the references, on any device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanopaged.kernels import fused_moe, rms_norm, sampler, silu_and_mul
from nanopaged.layers import cpu_gemm


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


def _linear_cuda(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: None
) -> torch.Tensor:
    # cuBLAS: at decode batch sizes a weight-streaming Triton GEMM measured slower on an H200
    # (0.4-0.8x on Qwen3-0.6B and Llama-3-8B layer shapes at 1-16 rows).
    return F.linear(x, weight, bias)


@dataclass(frozen=True)
class Backend:
    """The ops a model's layers call. triton: the layers with a fused form of several ops
    (rotary with Qwen3's q/k norms, paged attention) take their Triton paths."""

    name: str
    triton: bool
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


TORCH = Backend(
    name="torch",
    triton=False,
    linear=cpu_gemm.linear,
    rms_norm=rms_norm.rms_norm_ref,
    silu_and_mul=silu_and_mul.silu_and_mul_ref,
    fused_moe=fused_moe.fused_moe_ref,
    sample=sampler.sample_ref,
)

TRITON = Backend(
    name="triton",
    triton=True,
    linear=_linear_cuda,
    rms_norm=_rms_norm_triton,
    silu_and_mul=_silu_and_mul_triton,
    fused_moe=fused_moe.fused_moe,
    sample=sampler.sample_fused,
)


def backend_for(device: torch.device | str) -> Backend:
    """Triton kernels on CUDA, the torch references on every other device."""
    return TRITON if torch.device(device).type == "cuda" else TORCH


class UsesBackend:
    """A layer that computes through a Backend: the references until one is bound."""

    backend: Backend = TORCH


def bind_backend(model: nn.Module, backend: Backend) -> None:
    """Give every layer of model that computes through a backend this one."""
    for module in model.modules():
        if isinstance(module, UsesBackend):
            module.backend = backend
