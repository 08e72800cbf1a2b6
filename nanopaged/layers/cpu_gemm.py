"""CPU GEMMs at decode sizes: weights prepacked once into oneDNN's layout.

torch's plain bf16 `F.linear` on CPU reorders the weight on every call; at decode batch sizes
that costs more than the multiply. Prepacked, a bf16 decode GEMM beats the fp32 one at batch 1
and is about 4x faster at batch 16 (benchmarks/cpu_bench.py --gemm). fp32 weights are packed
too: oneDNN's fp32 GEMM beat torch's `F.linear` (MKL) at 16 rows by 10-35% on SmolLM2's shapes
(the LM head most) on an AVX2 EPYC; at one row fp32 runs the C GEMV of kernels/cpu_native.c
on the plain weight (native_linear), except on the LM head. Their sums run in another order
(within fp32 rounding of F.linear's). Large row counts (prefill) stay on `F.linear`, which is
faster there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanopaged.kernels import cpu_native

# Rows up to this many use the packed weight; more rows use F.linear (measured crossover).
PACKED_MAX_ROWS = 256
# The batch size oneDNN tunes the packed layout for (decode-sized).
_PACK_BATCH_HINT = 16
# fp32: the packed weight for 2 to 32 rows (even with F.linear from 64 rows on), and for one
# row only from this size on (the LM head).
_F32_PACKED_MAX_ROWS = 32
_F32_ONE_ROW_MIN_BYTES = 32 << 20


def onednn_bf16() -> bool:
    """Whether oneDNN runs bf16 GEMMs on this CPU (natively, or emulated on AVX-512 cores);
    LLM's default dtype asks the stricter platform.cpu_native_bf16."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def can_pack(weight: torch.Tensor) -> bool:
    """Whether weight is an fp32 or bf16 matrix oneDNN can multiply on this CPU (the caller
    knows it lies in CPU memory)."""
    if weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and onednn_bf16())


def _takes_packed(rows: int, weight: torch.Tensor) -> bool:
    """Whether x W^T of `rows` rows runs faster through the packed weight (measured)."""
    if weight.dtype != torch.float32:
        return rows <= PACKED_MAX_ROWS
    if rows == 1:
        return weight.nbytes >= _F32_ONE_ROW_MIN_BYTES
    return rows <= _F32_PACKED_MAX_ROWS


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] in oneDNN's blocked layout (usable only by packed_linear)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """x W^T (+ b); through the packed copy of weight when there is one and x has few rows."""
    if packed is not None and x.dim() == 2 and _takes_packed(x.shape[0], weight):
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def native_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """linear, except one fp32 row on a weight under the packed LM head's size runs the C GEMV
    (cpu_native.linear_row, on the plain weight), which streams the weight at one row faster
    than F.linear or the packed copy; for the op table of a model whose C kernels built."""
    if (
        x.dtype == weight.dtype == torch.float32
        and x.dim() == 2
        and x.shape[0] == 1
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and weight.nbytes < _F32_ONE_ROW_MIN_BYTES
    ):
        return cpu_native.linear_row(x, weight, bias)
    return linear(x, weight, bias, packed)


def pack_model(model: nn.Module) -> int:
    """Give every module with a `packed_weight` slot a packed copy of its weight, where
    can_pack allows; returns how many were packed. Call after the weights are loaded, for a
    model on the CPU (TorchAttention.bind with pack_weights)."""
    count = 0
    for module in model.modules():
        if hasattr(module, "packed_weight") and can_pack(module.weight):
            module.packed_weight = pack_weight(module.weight)
            count += 1
    return count
