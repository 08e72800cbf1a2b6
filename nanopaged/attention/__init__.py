"""Paged attention behind one interface (AttentionBackend), one class per implementation:
Triton kernels on CUDA (triton.py), the C kernels for bfloat16 on a CPU (cpu_native.py), the
torch references anywhere else (torch_ref.py).

attention_backend is the one place that picks by device type the code a model computes with;
the backend it returns names the op table of the model's other layers (layers/backend.py).
"""

from __future__ import annotations

import torch

from nanopaged.attention.base import AttentionBackend, DecodeGraphInputs, HostArrays
from nanopaged.attention.cpu_native import CpuNativeAttention
from nanopaged.attention.layer import Attention
from nanopaged.attention.metadata import AttentionMetadata
from nanopaged.attention.torch_ref import TorchAttention, TorchMetadata
from nanopaged.attention.triton import TritonAttention, TritonMetadata
from nanopaged.kernels import cpu_native
from nanopaged.platform import platform_of

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionMetadata",
    "CpuNativeAttention",
    "DecodeGraphInputs",
    "HostArrays",
    "TorchAttention",
    "TorchMetadata",
    "TritonAttention",
    "TritonMetadata",
    "attention_backend",
]


def attention_backend(device: torch.device | str, dtype: torch.dtype | None) -> AttentionBackend:
    """A new backend for a model of dtype on device: the Triton kernels on GPUs; on a CPU the
    C kernels for bfloat16 and fp32 where they compiled (kernels/cpu_native.load; fp32 models
    use its decode attention only), else the torch references."""
    if platform_of(device).gpu:
        return TritonAttention()
    if dtype in (torch.bfloat16, torch.float32) and cpu_native.available():
        return CpuNativeAttention()
    return TorchAttention(pack_weights=True)
