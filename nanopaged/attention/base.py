"""The interface every attention backend implements: prepare a step's metadata, run a layer's
attention, and give the decode graphs their static inputs."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from torch import nn

from nanopaged.attention.layer import Attention
from nanopaged.attention.metadata import AttentionMetadata
from nanopaged.kernels.store_kv import channel_major, is_fp8
from nanopaged.layers.backend import Backend, bind_backend

if TYPE_CHECKING:
    from nanopaged.layers.norm import RMSNorm
    from nanopaged.layers.rotary import RotaryEmbedding

# A step's host arrays (engine/step_inputs.host_arrays): positions [num_tokens] int64, slots
# [num_tokens] int64 (-1: do not store), tables [batch, max_blocks] int32, context_lens [batch]
# int32 (tokens in the cache after the step), cu_seqlens_q [batch + 1] int32.
HostArrays = Mapping[str, np.ndarray]


class DecodeGraphInputs(Protocol):
    """A backend's static attention inputs for CUDA graphs of decode steps: captured once per
    bucket, refilled before each replay."""

    def metadata(self, batch_size: int) -> AttentionMetadata:
        """The metadata a bucket of batch_size rows is captured with (views of the buffers)."""

    def fill(
        self, slots: np.ndarray, tables: np.ndarray, context_lens: np.ndarray, bucket: int
    ) -> None:
        """This step's rows into the buffers; rows up to bucket are padding (store nothing,
        read nothing)."""


def host_to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on device, copied with non_blocking=True."""
    return torch.from_numpy(a).to(device, non_blocking=True)


class AttentionBackend(ABC):
    """One implementation of paged attention under the model's attention layers; ops: the op
    table the model's other layers compute with beside it.

    A new backend is a subclass and a line in nanopaged.attention.attention_backend.
    """

    name: str
    ops: Backend

    def bind(self, model: nn.Module) -> None:
        """Make model compute through this backend: its attention layers, and through ops the
        rest. Call after the weights are loaded."""
        bind_backend(model, self.ops)
        for module in model.modules():
            if isinstance(module, Attention):
                module.backend = self

    def bind_kv(self, layers: list[Attention], cache: torch.Tensor) -> None:
        """Point each attention layer at its K and V in cache ([2, num_layers, num_blocks,
        block_size, num_kv_heads, head_dim], contiguous). An 8-bit V is kept channel-major
        (store_kv.channel_major), the order the decode kernel reads it in (the references
        read any strides); block copies and swaps move whole blocks, so they do not depend
        on it."""
        for i, layer in enumerate(layers):
            layer.k_cache = cache[0, i]
            layer.v_cache = channel_major(cache[1, i]) if is_fp8(cache.dtype) else cache[1, i]

    @abstractmethod
    def prepare_metadata(
        self, host: HostArrays, device: torch.device
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """The step's positions and its metadata (this backend's subclass) on device."""

    @abstractmethod
    def forward(
        self,
        layer: Attention,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        rotary: RotaryEmbedding,
        q_norm: RMSNorm | None,
        k_norm: RMSNorm | None,
    ) -> torch.Tensor:
        """One layer's rotary (after the q/k norms, when given), K/V store and attention over
        layer's cache: [num_tokens, num_heads, head_dim]."""

    def compile_ahead(self, layer: Attention, dtype: torch.dtype) -> None:
        """Compile now the kernel variants a run may first ask for mid-run (layer: one of the
        model's attention layers, its cache bound; dtype: the model's). None by default."""
        return None

    def graph_capture(self) -> contextlib.AbstractContextManager:
        """The context the decode graphs warm up and capture in (a replay runs no Python)."""
        return contextlib.nullcontext()

    def decode_graph_inputs(
        self, max_batch_size: int, max_blocks: int, max_model_len: int, device: torch.device
    ) -> DecodeGraphInputs:
        """Static inputs for decode graphs of up to max_batch_size rows of max_blocks blocks."""
        raise NotImplementedError(f"the {self.name} attention backend has no decode graphs")

    @staticmethod
    def shared_metadata(host: HostArrays, device: torch.device) -> tuple[torch.Tensor, dict]:
        """The step's positions and the AttentionMetadata fields every backend fills alike."""
        cu = host["cu_seqlens_q"]
        context_lens = host["context_lens"]
        return host_to_device(host["positions"], device), dict(
            slot_mapping=host_to_device(host["slots"], device),
            block_tables=host_to_device(host["tables"], device),
            context_lens=host_to_device(context_lens, device),
            cu_seqlens_q=host_to_device(cu, device),
            max_seqlen_q=int((cu[1:] - cu[:-1]).max()),
            max_context_len=int(context_lens.max()),
        )
