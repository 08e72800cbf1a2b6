"""Decode steps replayed from CUDA graphs captured per batch-size bucket: the forward pass,
then (for steps that sample one token per row, plain or under a grammar's mask) the LM head
and the sampler."""

from __future__ import annotations

import bisect
import gc
from collections import Counter
from collections.abc import Callable
from functools import partial
from itertools import product

import numpy as np
import torch
from torch import nn

from nanopaged.attention import AttentionBackend, AttentionMetadata
from nanopaged.sampling.ops import (
    SAMPLER_PATHS,
    SamplingTensors,
    SlotSettings,
    TokenMask,
    sample,
    sampler_path,
    with_path,
)
from nanopaged.sampling.output import DeviceSamples, GraphSampler


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Buckets 1, 2, 4, 8, then every 16 up to max_num_seqs (which is always a bucket)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    """Static input buffers plus one captured forward per bucket; a step pads up to a bucket.

    The attention backend gives the attention inputs (decode_graph_inputs): buffers wide
    enough for any step up to max_model_len, padded rows storing and reading nothing.

    With lm_head (hidden [rows, hidden_size] -> logits [rows, vocab]), each bucket also holds
    two captured samplers per path of SAMPLER_PATHS, plain and masked: hidden -> logits ->
    token ids and each token's logit (DeviceSamples), reading its per-row settings from
    `slots` (persistent; padded rows greedy), the masked one also structured outputs' masks
    from `mask_words` / `mask_rows`. A plain step replays its forward and then its sampler,
    with no Python in between; a masked step replays its sampler once its masks are known
    (GraphSampler).
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
        vocab_size: int = 0,
        *,
        backend: AttentionBackend,
    ) -> None:
        self.model = model
        self.backend = backend
        self.lm_head = lm_head
        self.batch_sizes = graph_batch_sizes(max_num_seqs)
        max_bs = self.batch_sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.attn_inputs = backend.decode_graph_inputs(max_bs, max_blocks, max_model_len, device)
        self.hidden = torch.zeros(max_bs, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.slots = SlotSettings(max_bs, device)
        # The captured samplers' token ids and their logits (outside the graphs' pool: no
        # capture reuses them).
        self.tokens = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.sampled_logits = torch.zeros(max_bs, dtype=torch.float32, device=device)
        # The masks the masked samplers read: words [2 * max_bs, ceil(vocab / 32)] (room for
        # the host's staged rows, StructuredBackend.masks) and each row's mask (-1: none).
        self.mask_words = torch.zeros(2 * max_bs if lm_head else 0, (vocab_size + 31) // 32,
                                      dtype=torch.int32, device=device)  # fmt: skip
        self.mask_rows = torch.full((max_bs,), -1, dtype=torch.int32, device=device)
        # (bucket, path, masked) -> its captured sampler
        self.samplers: dict[tuple[int, str, bool], torch.cuda.CUDAGraph] = {}
        self.sampled_steps: Counter[str] = Counter()  # per sampler path: steps sampled here

    def _meta(self, bs: int) -> AttentionMetadata:
        return self.attn_inputs.metadata(bs)

    def capture(self) -> None:
        """Capture every bucket's graphs, with no garbage collection in between: torch no
        longer collects before a capture, and a collection inside one may drop another LLM
        (a cycle) whose release synchronizes the device, which invalidates the capture."""
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._capture()
        finally:
            if collecting:
                gc.enable()

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for bs in reversed(self.batch_sizes):
            args = (self.input_ids[:bs], self.positions[:bs], self._meta(bs))
            with self.backend.graph_capture():  # e.g. small GEMMs: the skinny kernel
                self.hidden[:bs] = self.model(*args)  # compiles kernels outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.hidden[:bs] = self.model(*args)
            pool = graph.pool()
            self.graphs[bs] = graph
            if self.lm_head is not None:
                for path, masked in product(SAMPLER_PATHS, (False, True)):
                    st = with_path(self.slots.view(bs), path)
                    self._sample(bs, st, masked)  # compiles this batch size's kernels
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        self._sample(bs, st, masked)
                    self.samplers[bs, path, masked] = graph
        torch.cuda.synchronize()

    def _sample(self, bs: int, st: SamplingTensors, masked: bool) -> None:
        # The LM head runs as in eager steps (cuBLAS): the skinny kernel is tuned for the
        # layers' shapes, not a 150k-row vocabulary.
        logits = self.lm_head(self.hidden[:bs])
        mask = TokenMask(self.mask_words, self.mask_rows[:bs]) if masked else None
        tokens = sample(logits, st, mask=mask).token_ids
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
        sampling: Callable[[], SamplingTensors] | None = None,
        masked: bool = False,
    ) -> torch.Tensor | DeviceSamples | GraphSampler:
        """One decode step for len(input_ids) sequences; returns hidden [batch, hidden_size],
        or with sampling (called once the forward pass is queued; it writes the settings into
        self.slots, as sampling_tensors(into=self.slots) does, and returns them) the samples:
        token ids [batch] int64 and their logits [batch] fp32. masked: the rows have grammar
        masks; their sampler is returned, to replay once the masks are in its buffers.

        pending: (rows, token ids) already on the device that overwrite those input ids; rows
        None: the token ids are all of them, in order.
        """
        bs = len(input_ids)
        bucket = self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]
        if pending is not None and pending[0] is None:
            self.input_ids[:bs].copy_(pending[1])
        else:
            self.input_ids[:bs].copy_(torch.from_numpy(input_ids), non_blocking=True)
            if pending is not None:
                self.input_ids.index_copy_(0, *pending)
        self.positions[:bs].copy_(torch.from_numpy(positions), non_blocking=True)
        self.attn_inputs.fill(slots, tables, context_lens, bucket)
        self.graphs[bucket].replay()
        if sampling is None:
            return self.hidden[:bs]
        settings = sampling()
        assert settings.temperatures.data_ptr() == self.slots.values.data_ptr()
        path = sampler_path(settings)
        if masked:
            # Nothing replays a forward pass in between: the sampler's replay comes before the
            # next step's (LLMEngine._launch).
            replay = partial(self._replay_sampler, bucket, bs, path, True)
            return GraphSampler(self.mask_words, self.mask_rows[:bs], replay)
        return self._replay_sampler(bucket, bs, path, False)

    def _replay_sampler(self, bucket: int, bs: int, path: str, masked: bool) -> DeviceSamples:
        self.samplers[bucket, path, masked].replay()
        self.sampled_steps[path] += 1
        # The tokens are a copy: the next replay overwrites the buffer, and the step's tokens
        # are read later (the next steps' input ids and penalty counts take them from the
        # device). The logits are a view: only their copy to the host reads them, queued on
        # this stream before any later replay.
        return DeviceSamples(self.tokens[:bs].clone(), self.sampled_logits[:bs])
