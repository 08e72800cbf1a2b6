"""Decode steps replayed from CUDA graphs captured per batch-size bucket: the forward pass,
then (for steps that sample nothing but one plain token per row) the LM head and the sampler."""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from nanopaged.kernels.paged_decode import longest_first
from nanopaged.layers.attention import AttentionMetadata
from nanopaged.layers.backend import graph_gemms
from nanopaged.sampling.ops import (
    SAMPLER_PATHS,
    SamplingTensors,
    SlotSettings,
    sample,
    sampler_path,
    with_path,
)
from nanopaged.sampling.output import DeviceSamples


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Buckets 1, 2, 4, 8, then every 16 up to max_num_seqs (which is always a bucket)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    """Static input buffers plus one captured forward per bucket; a step pads up to a bucket.

    The block-table buffer is as wide as max_model_len needs, so no step can overflow it, and
    padded rows get slot -1 and context 0: they store nothing and read nothing.

    With lm_head (hidden [rows, hidden_size] -> logits [rows, vocab]), each bucket also holds
    one captured sampler per path of SAMPLER_PATHS: hidden -> logits -> token ids and each
    token's logit (DeviceSamples), reading its per-row settings from `slots` (persistent;
    padded rows greedy). A step that samples in the graph replays its forward and then its
    sampler, with no Python in between.
    """

    def __init__(
        self,
        model: nn.Module,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.model = model
        self.lm_head = lm_head
        self.max_model_len = max_model_len
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        max_bs = self.batch_sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        # The decode kernel's launch order: longest context first, then the padding rows.
        self.decode_order = torch.arange(max_bs, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(max_bs, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.slots = SlotSettings(max_bs, device)
        # The captured samplers' token ids and their logits (outside the graphs' pool: no
        # capture reuses them).
        self.tokens = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.sampled_logits = torch.zeros(max_bs, dtype=torch.float32, device=device)
        self.samplers: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.sampled_steps: Counter[str] = Counter()  # per sampler path: steps sampled here

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs],
            context_lens=self.context_lens[:bs],
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            max_seqlen_q=1,
            max_context_len=self.max_model_len,
            decode_order=self.decode_order[:bs],
        )

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for bs in reversed(self.batch_sizes):
            args = (self.input_ids[:bs], self.positions[:bs], self._meta(bs))
            with graph_gemms():  # small GEMMs: the skinny kernel, in graphs only
                self.hidden[:bs] = self.model(*args)  # compiles kernels outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.hidden[:bs] = self.model(*args)
            pool = graph.pool()
            self.graphs[bs] = graph
            if self.lm_head is not None:
                for path in SAMPLER_PATHS:
                    st = with_path(self.slots.view(bs), path)
                    self._sample(bs, st)  # compiles this batch size's kernels
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self._sample(bs, st)
                    self.samplers[bs, path] = graph
        torch.cuda.synchronize()

    def _sample(self, bs: int, st: SamplingTensors) -> None:
        # The LM head runs as in eager steps (cuBLAS): the skinny kernel is tuned for the
        # layers' shapes, not a 150k-row vocabulary.
        logits = self.lm_head(self.hidden[:bs])
        tokens = sample(logits, st).token_ids
        self.tokens[:bs] = tokens
        self.sampled_logits[:bs] = logits.gather(1, tokens[:, None])[:, 0]

    def can_run(self, batch_size: int) -> bool:
        return bool(self.graphs) and batch_size <= self.batch_sizes[-1]

    @property
    def can_sample(self) -> bool:
        return bool(self.samplers)

    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        tables: np.ndarray,
        context_lens: np.ndarray,
        pending: tuple[torch.Tensor | None, torch.Tensor] | None = None,
        sampling: SamplingTensors | None = None,
    ) -> torch.Tensor | DeviceSamples:
        """One decode step for len(input_ids) sequences; returns hidden [batch, hidden_size],
        or with sampling (settings in self.slots, as sampling_tensors(into=self.slots) wrote
        them) the samples: token ids [batch] int64 and their logits [batch] fp32.

        pending: (rows, token ids) already on the device that overwrite those input ids; rows
        None: the token ids are all of them, in order.
        """
        bs = len(input_ids)
        bucket = self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]
        width = tables.shape[1]
        if pending is not None and pending[0] is None:
            self.input_ids[:bs].copy_(pending[1])
        else:
            self.input_ids[:bs].copy_(torch.from_numpy(input_ids), non_blocking=True)
            if pending is not None:
                self.input_ids.index_copy_(0, *pending)
        self.positions[:bs].copy_(torch.from_numpy(positions), non_blocking=True)
        self.slot_mapping[:bs].copy_(torch.from_numpy(slots), non_blocking=True)
        self.context_lens[:bs].copy_(torch.from_numpy(context_lens), non_blocking=True)
        self.block_tables[:bs, :width].copy_(torch.from_numpy(tables), non_blocking=True)
        order = longest_first(context_lens)
        if bucket > bs:
            self.slot_mapping[bs:bucket].fill_(-1)
            self.context_lens[bs:bucket].fill_(0)
            order = np.concatenate([order, np.arange(bs, bucket, dtype=np.int32)])
        self.decode_order[:bucket].copy_(torch.from_numpy(order), non_blocking=True)
        self.graphs[bucket].replay()
        if sampling is None:
            return self.hidden[:bs]
        assert sampling.temperatures.data_ptr() == self.slots.values.data_ptr()
        path = sampler_path(sampling)
        self.samplers[bucket, path].replay()
        self.sampled_steps[path] += 1
        # The tokens are a copy: the next replay overwrites the buffer, and the step's tokens
        # are read later (the next steps' input ids and penalty counts take them from the
        # device). The logits are a view: only their copy to the host reads them, queued on
        # this stream before any later replay.
        return DeviceSamples(self.tokens[:bs].clone(), self.sampled_logits[:bs])
