"""Where the layers' ops run, chosen once per model: Triton kernels on CUDA; on a CPU the
kernels' torch references (the same functions the kernel tests use as their oracles), and
for bfloat16 models the C kernels of kernels/cpu_native.c where they compiled.

The ModelRunner picks the backend for its device and dtype and binds it to every layer that
computes (`bind_backend`); a layer built outside a runner computes with the references, on
any device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanopaged.kernels import (
    cpu_native,
    fused_moe,
    paged_decode,
    penalties,
    rms_norm,
    rotary,
    sampler,
    sampler_chunks,
    silu_and_mul,
    skinny_gemm,
    store_kv,
)
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


# Decode-sized GEMMs (1 to 16 rows, 16-bit) of CUDA-graph decode steps go to the skinny
# kernel, except 2+ rows on weights this large, where cuBLAS already streams at the copy rate
# (Llama-3-8B's gate_up, 224 MB: 0.94-0.97x). fp32 stays on cuBLAS (exact, the HF parity
# tests), and so do eager steps: there a Triton launch costs more host time than cuBLAS's,
# and small eager steps are bound by the host (bench --sampling's logprobs row lost 15-20%
# with the kernel in every small step, and nothing with it in graph steps only).
_SKINNY_LARGE_WEIGHT = 64 << 20
_graph_gemms = False


@contextlib.contextmanager
def graph_gemms():
    """Decode GEMMs run inside this block take the skinny kernel where it wins: the CUDA
    graph runner's warm-up and capture of each bucket (a replay runs no Python)."""
    global _graph_gemms
    previous, _graph_gemms = _graph_gemms, True
    try:
        yield
    finally:
        _graph_gemms = previous


def _linear_cuda(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: None
) -> torch.Tensor:
    # H200, CUDA graphs: the skinny kernel beats cuBLAS at 1 row on every Qwen3-0.6B and
    # Llama-3-8B layer shape (1.1-3.8x) and ties or wins at 2-16 rows
    # (benchmarks/skinny_gemm_bench.py).
    if (
        _graph_gemms
        and x.dim() == 2
        and x.shape[0] <= skinny_gemm.MAX_M
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(1) == 1
        and weight.is_contiguous()
        and (x.shape[0] == 1 or weight.numel() * weight.element_size() < _SKINNY_LARGE_WEIGHT)
    ):
        return skinny_gemm.skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _store_kv_ref(key, value, k_cache, v_cache, meta, k_scale=None, v_scale=None) -> None:
    # Whether a slot is -1 (a token not to store) is read back once per step, by the first layer.
    if meta.skips_slots is None:
        meta.skips_slots = bool((meta.slot_mapping < 0).any())
    store_kv.store_kv_ref(
        key, value, k_cache, v_cache, meta.slot_mapping,
        k_scale=k_scale, v_scale=v_scale, may_skip=meta.skips_slots,
    )  # fmt: skip


def _decode_ref(q, k_cache, v_cache, meta, scale, k_scale=None, v_scale=None) -> torch.Tensor:
    # The gather plan is shared by every layer of the step, built by the first.
    if meta.decode_plan is None:
        meta.decode_plan = paged_decode.decode_plan(
            meta.block_tables, meta.context_lens, k_cache.shape[1]
        )
    return paged_decode.paged_decode_ref(
        q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
        plan=meta.decode_plan, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip


def _rms_norm_native(x, weight, eps, residual=None):
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return rms_norm.rms_norm_ref(x, weight, eps, residual)
    return cpu_native.rms_norm(x, weight, eps, residual)


def _rotate_native(x, cos_t, signed_sin_t):
    if x.dtype != torch.bfloat16 or x.stride(-1) != 1:
        return rotary.rotate_ref(x, cos_t, signed_sin_t)
    return cpu_native.rotate(x, cos_t, signed_sin_t)


def _heads_contiguous(x: torch.Tensor) -> bool:
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _store_kv_native(key, value, k_cache, v_cache, meta, k_scale=None, v_scale=None) -> None:
    if k_cache.dtype != torch.bfloat16 or not (_heads_contiguous(key) and _heads_contiguous(value)):
        return _store_kv_ref(key, value, k_cache, v_cache, meta, k_scale, v_scale)
    cpu_native.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)


def _decode_native(q, k_cache, v_cache, meta, scale, k_scale=None, v_scale=None):
    if k_cache.dtype != torch.bfloat16 or q.dtype != torch.bfloat16:
        return _decode_ref(q, k_cache, v_cache, meta, scale, k_scale, v_scale)
    return cpu_native.paged_decode(
        q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale, meta.max_context_len
    )


def _rotary_decode_native(attn, rope, positions, q, k, v, meta) -> torch.Tensor:
    k_cache = attn.k_cache
    assert k_cache is not None, "KV cache not bound"
    if not (
        q.dtype == k_cache.dtype == torch.bfloat16
        and rope.cos.dtype == torch.float32
        and positions.dtype == meta.slot_mapping.dtype == torch.int64
    ):
        q, k = rope(positions, q, k)
        return attn(q, k, v, meta)
    return cpu_native.rotary_decode(
        q, k, v, positions, rope.cos, rope.sin, k_cache, attn.v_cache, meta.slot_mapping,
        meta.block_tables, meta.context_lens, attn.scale, meta.max_context_len,
    )  # fmt: skip


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
    # logits [batch, vocab] -> logits.argmax(dim=-1) (int64 [batch])
    argmax: Callable
    # (logits fp32, rows, state_rows, counts, prompt, penalties [3, n]): penalties in place,
    # see kernels/penalties.penalize_rows_ref
    penalize_rows: Callable = penalties.penalize_rows_ref
    # The CPU layers' ops (the Triton layers take fused kernels instead):
    # (x [tokens, heads, dim], cos_t, signed_sin_t) -> rotated x, see kernels/rotary.rotate_ref
    rotate: Callable = rotary.rotate_ref
    # (key, value, k_cache, v_cache, meta, k_scale, v_scale): this step's K/V into the cache
    store_kv: Callable = _store_kv_ref
    # (q, k_cache, v_cache, meta, scale, k_scale, v_scale) -> decode attention's output
    decode_attention: Callable = _decode_ref
    # A decode step's rotary, KV store and attention in one call, or None (each on its own):
    # (attention layer, rotary layer, positions, q, k, v, meta) -> attention's output
    rotary_decode: Callable | None = None


TORCH = Backend(
    name="torch",
    triton=False,
    linear=cpu_gemm.linear,
    rms_norm=rms_norm.rms_norm_ref,
    silu_and_mul=silu_and_mul.silu_and_mul_ref,
    fused_moe=fused_moe.fused_moe_ref,
    sample=sampler.sample_ref,
    argmax=sampler.argmax_ref,
)

TRITON = Backend(
    name="triton",
    triton=True,
    linear=_linear_cuda,
    rms_norm=_rms_norm_triton,
    silu_and_mul=_silu_and_mul_triton,
    fused_moe=fused_moe.fused_moe,
    sample=sampler_chunks.sample_fused,
    argmax=sampler_chunks.argmax_fused,
    penalize_rows=penalties.penalize_rows,
)


# bfloat16 models on a CPU where kernels/cpu_native.c compiled: its kernels for the norms,
# rotary, the KV store and decode attention; the rest (and fp8 caches) as TORCH.
CPU_NATIVE = Backend(
    name="cpu-native",
    triton=False,
    linear=cpu_gemm.linear,
    rms_norm=_rms_norm_native,
    # SiLU stays torch's: its vectorized exp beat a C loop here (bound by arithmetic)
    silu_and_mul=silu_and_mul.silu_and_mul_ref,
    fused_moe=fused_moe.fused_moe_ref,
    sample=sampler.sample_ref,
    argmax=sampler.argmax_ref,
    rotate=_rotate_native,
    store_kv=_store_kv_native,
    decode_attention=_decode_native,
    rotary_decode=_rotary_decode_native,
)


def backend_for(device: torch.device | str, dtype: torch.dtype | None = None) -> Backend:
    """Triton kernels on CUDA; on other devices the torch references, or for a bfloat16 model
    (dtype) on a CPU the C kernels when they compile (kernels/cpu_native.load)."""
    device = torch.device(device)
    if device.type == "cuda":
        return TRITON
    if device.type == "cpu" and dtype == torch.bfloat16 and cpu_native.available():
        return CPU_NATIVE
    return TORCH


class UsesBackend:
    """A layer that computes through a Backend: the references until one is bound."""

    backend: Backend = TORCH


def bind_backend(model: nn.Module, backend: Backend) -> None:
    """Give every layer of model that computes through a backend this one."""
    for module in model.modules():
        if isinstance(module, UsesBackend):
            module.backend = backend
