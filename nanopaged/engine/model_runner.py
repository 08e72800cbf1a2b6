"""Owns the model and the KV tensor; turns a ScheduledBatch into sampled tokens."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from nanopaged.config import EngineConfig, ModelConfig
from nanopaged.engine.block_tables import BlockTableBuilder
from nanopaged.engine.cuda_graph import DecodeGraphs
from nanopaged.engine.sample_output import SampleOutput
from nanopaged.engine.sampling import (
    mask_early_stops,
    needs_sample_outputs,
    row_stream,
    sample_sequences,
    sampling_tensors,
)
from nanopaged.engine.scheduler import ScheduledBatch
from nanopaged.engine.sequence import Sequence
from nanopaged.engine.swap import allocate_cpu_kv_cache, run_block_ops
from nanopaged.layers.attention import Attention, AttentionMetadata
from nanopaged.layers.sampler import SamplingTensors, sample
from nanopaged.loader import load_weights
from nanopaged.models import build_model

logger = logging.getLogger(__name__)


class StepHandle:
    """A launched step's samples: on the device, copying to the host, or already there."""

    def __init__(self, outputs: list | None = None) -> None:
        self.outputs = outputs
        self.tokens: torch.Tensor | None = None  # [num_sampled] int64 on the device
        self._host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None

    @classmethod
    def copy_to_host(cls, tokens: torch.Tensor) -> StepHandle:
        handle = cls()
        handle.tokens = tokens
        if tokens.is_cuda:
            handle._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            handle._host.copy_(tokens, non_blocking=True)
            handle._event = torch.cuda.Event()
            handle._event.record()
        else:
            handle._host = tokens
        return handle

    @property
    def plain(self) -> bool:
        """Bare token ids (not SampleOutputs), kept on the device for the next step."""
        return self.tokens is not None

    def result(self) -> list[int] | list[SampleOutput]:
        """The samples, waiting for the device if needed."""
        if self.outputs is None:
            if self._event is not None:
                self._event.synchronize()
            self.outputs = self._host.tolist()
        return self.outputs

def kv_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block: K and V of block_size tokens in every layer."""
    c = model_config
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * elem


# KV budget on CPU when kv_cache_memory is not given.
DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30


class ModelRunner:
    """Loads the model, sizes and allocates the paged KV cache, runs steps and samples."""

    def __init__(
        self,
        model_dir: Path,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.model_config = model_config
        self.config = engine_config
        self.max_model_len = max_model_len
        self.device = device
        self.dtype = dtype
        self.block_size = engine_config.block_size
        torch.manual_seed(engine_config.seed)
        # A budget the config fixes is checked before anything is loaded.
        profile = device.type == "cuda" and engine_config.kv_cache_memory is None
        if not profile:
            budget = engine_config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY
            self.num_blocks = self._blocks_for_budget(budget)
        with torch.device(device):
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                self.model = build_model(model_config)
            finally:
                torch.set_default_dtype(default_dtype)
        load_weights(self.model, model_dir)
        self.model.eval()
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        if profile:
            self.num_blocks = self._blocks_for_budget(self._profile_cuda_budget())
        # kv_cache: [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_cache = torch.empty(
            2,
            model_config.num_layers,
            self.num_blocks,
            self.block_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            dtype=dtype,
            device=device,
        )
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache = self.kv_cache[0, i]
            layer.v_cache = self.kv_cache[1, i]
        self._tables = BlockTableBuilder()
        # The CPU swap pool (preemption_mode="swap"), see allocate_swap_space.
        self.cpu_kv_cache: torch.Tensor | None = None
        self._sampling_cache: tuple[tuple[int, ...], SamplingTensors] | None = None
        self.graphs: DecodeGraphs | None = None
        if device.type == "cuda" and not engine_config.enforce_eager:
            self.graphs = DecodeGraphs(
                self.model,
                engine_config.max_num_seqs,
                max_model_len,
                self.block_size,
                model_config.hidden_size,
                dtype,
                device,
            )
            self.graphs.capture()

    def allocate_swap_space(self, num_blocks: int) -> None:
        """Allocate the CPU swap pool: num_blocks blocks shaped like the device cache's."""
        self.cpu_kv_cache = allocate_cpu_kv_cache(self.kv_cache, num_blocks)

    # ---- sizing --------------------------------------------------------------------------
    @property
    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.model_config, self.block_size, self.dtype)

    def _blocks_for_budget(self, budget: int) -> int:
        cfg = self.config
        num_blocks = budget // self.kv_bytes_per_block
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        if num_blocks < blocks_per_seq:
            knobs = "kv_cache_memory"
            if self.device.type == "cuda":
                knobs += " or gpu_memory_utilization"
            raise ValueError(
                f"the KV cache holds {num_blocks * self.block_size} tokens "
                f"({budget / 2**20:.1f} MiB at {self.kv_bytes_per_block} bytes per block of "
                f"{self.block_size}), less than one sequence of max_model_len="
                f"{self.max_model_len}; raise {knobs}, or lower max_model_len"
            )
        # More blocks than every sequence at full length could use is wasted memory.
        return min(num_blocks, blocks_per_seq * cfg.max_num_seqs)

    def _profile_cuda_budget(self) -> int:
        """Bytes left for KV under the utilization cap after the weights, the peak of a full
        prefill step with its sampling (every sampling option on), and what CUDA graphs of
        decode steps will hold."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        # The largest step: max_num_batched_tokens, in sequences of at most max_model_len.
        total = self.config.max_num_batched_tokens
        lens = [self.max_model_len] * (total // self.max_model_len)
        if total % self.max_model_len:
            lens.append(total % self.max_model_len)
        blocks = [-(-n // self.block_size) for n in lens]
        c = self.model_config
        scratch = torch.empty(
            2, c.num_layers, sum(blocks), self.block_size, c.num_kv_heads, c.head_dim,
            dtype=self.dtype, device=self.device,
        )
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = scratch[0, i], scratch[1, i]
        firsts = np.cumsum([0] + blocks[:-1])
        tables = [list(range(f, f + b)) for f, b in zip(firsts, blocks)]
        positions, meta = self._metadata(lens, [0] * len(lens), tables)
        input_ids = torch.zeros(total, dtype=torch.long, device=self.device)
        rows = min(self.config.max_num_seqs, total)
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, meta)
            self._profile_sampling(self.model.compute_logits(hidden[:rows]).float())
            del hidden
            graph_bytes = 0
            if not self.config.enforce_eager:
                # A decode forward at max_num_seqs: the activations the graphs' pool keeps.
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                decode_lens = [1] * self.config.max_num_seqs
                starts = [min(b * self.block_size, self.max_model_len) - 1 for b in blocks]
                starts = (starts * self.config.max_num_seqs)[: len(decode_lens)]
                table = (tables * self.config.max_num_seqs)[: len(decode_lens)]
                positions, meta = self._metadata(decode_lens, starts, table)
                ids = torch.zeros(len(decode_lens), dtype=torch.long, device=self.device)
                self.model(ids, positions, meta)
                torch.cuda.synchronize()
                graph_bytes = torch.cuda.max_memory_allocated() - before
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - scratch.numel() * scratch.element_size()
        del scratch
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = None
        torch.cuda.empty_cache()
        free, total_bytes = torch.cuda.mem_get_info()
        not_torch = total_bytes - free - torch.cuda.memory_reserved()
        # Graph capture also takes workspaces and allocator slack beyond the activations.
        margin = 256 << 20
        budget = int(total_bytes * self.config.gpu_memory_utilization)
        return max(0, budget - peak - graph_bytes - not_torch - margin)

    def _profile_sampling(self, logits: torch.Tensor) -> None:
        """Run the sampler's most memory-hungry path over logits rows: [rows, vocab] fp32."""
        rows, vocab = logits.shape
        ones = torch.ones(rows, device=self.device)
        st = SamplingTensors(
            temperatures=ones,
            top_ks=torch.full((rows,), max(1, vocab // 2), dtype=torch.int32, device=self.device),
            top_ps=ones * 0.9,
            min_ps=ones * 0.01,
            seeds=torch.zeros(rows, dtype=torch.int64, device=self.device),
            offsets=torch.zeros(rows, dtype=torch.int64, device=self.device),
        )
        sample(logits, st, num_logprobs=20)
        logits.log_softmax(-1).topk(min(20, vocab), dim=-1)

    # ---- one step ------------------------------------------------------------------------
    def _host_arrays(
        self, num_scheduled: list[int], starts: list[int], tables: np.ndarray
    ) -> dict[str, np.ndarray]:
        """The step's positions, slots and lengths, built in bulk on the host.

        tables: [batch, max_blocks] int32 block tables.
        """
        bs = self.block_size
        batch = len(num_scheduled)
        q_lens = np.asarray(num_scheduled, dtype=np.int64)
        starts_np = np.asarray(starts, dtype=np.int64)
        cu = np.zeros(batch + 1, dtype=np.int32)
        np.cumsum(q_lens, out=cu[1:])
        if int(cu[-1]) == batch:  # decode: one token per sequence
            seq_idx, pos = np.arange(batch), starts_np
        else:
            seq_idx = np.repeat(np.arange(batch), q_lens)
            pos = np.arange(cu[-1]) - np.repeat(cu[:-1].astype(np.int64) - starts_np, q_lens)
        slots = tables[seq_idx, pos // bs].astype(np.int64) * bs + pos % bs
        return dict(
            positions=pos,
            slots=slots,
            tables=tables,
            context_lens=(starts_np + q_lens).astype(np.int32),
            cu_seqlens_q=cu,
        )

    def _metadata(
        self, num_scheduled: list[int], starts: list[int], block_tables: list[list[int]]
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """Positions of the scheduled tokens and the metadata to find them in the cache."""
        tables = np.zeros((len(block_tables), max(map(len, block_tables))), dtype=np.int32)
        for i, t in enumerate(block_tables):
            tables[i, : len(t)] = t
        return self._device_metadata(self._host_arrays(num_scheduled, starts, tables))

    def _device_metadata(
        self, host: dict[str, np.ndarray]
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        dev = self.device

        def put(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(dev, non_blocking=True)

        cu = host["cu_seqlens_q"]
        return put(host["positions"]), AttentionMetadata(
            slot_mapping=put(host["slots"]),
            block_tables=put(host["tables"]),
            context_lens=put(host["context_lens"]),
            cu_seqlens_q=put(cu),
            max_seqlen_q=int((cu[1:] - cu[:-1]).max()),
            max_context_len=int(host["context_lens"].max()),
        )

    def _sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        """Per-row settings; the greedy flag and seeds are reused while consecutive steps
        sample the same sequences, the offsets (output positions) are new each step."""
        params = [s.sampling_params for s in seqs]
        offsets = [s.num_output_tokens for s in seqs]
        key = tuple(s.seq_id for s in seqs)
        if self._sampling_cache is not None and self._sampling_cache[0] == key:
            st = self._sampling_cache[1]
            if st.all_greedy:
                return st
            host = torch.tensor(offsets, dtype=torch.int64)
            return replace(st, offsets=host.to(self.device, non_blocking=True))
        st = sampling_tensors(params, [row_stream(s) for s in seqs], offsets, self.device)
        self._sampling_cache = (key, st)
        return st

    def run(
        self, batch: ScheduledBatch, eos_token_ids: set[int]
    ) -> list[int] | list[SampleOutput]:
        """Compute the batch's scheduled tokens; returns a token for each sequence that samples
        (a SampleOutput each when a fork, a beam, logprobs or penalties are involved)."""
        return self.launch(batch, eos_token_ids).result()

    @torch.inference_mode()
    def launch(
        self, batch: ScheduledBatch, eos_token_ids: set[int], prev: StepHandle | None = None
    ) -> StepHandle:
        """Queue the batch's forward pass and sampling on the device without waiting for them.

        Sequences whose last token is a placeholder take it from `prev`'s sampled tokens on the
        device (asynchronous scheduling).
        """
        # Swaps and copy-on-write copies go before the forward (and outside any CUDA graph).
        run_block_ops(
            self.kv_cache,
            self.cpu_kv_cache,
            batch.blocks_to_swap_out,
            batch.blocks_to_swap_in,
            batch.blocks_to_copy,
        )
        seqs = batch.seqs
        starts = [s.num_computed_tokens for s in seqs]
        input_ids: list[int] = []
        for seq, start, n in zip(seqs, starts, batch.num_scheduled_tokens):
            input_ids.extend(seq.token_ids[start : start + n])
        host = self._host_arrays(batch.num_scheduled_tokens, starts, self._tables.build(seqs))
        sampling_rows = [i for i in range(len(seqs)) if batch.samples(i)]
        ids_np = np.asarray(input_ids, dtype=np.int64)
        pending = self._pending_inputs(seqs, host["cu_seqlens_q"], prev)
        if pending is not None:
            ids_np[pending[0]] = 0  # placeholders: the real ids are copied in on the device
        if self.graphs is not None and len(ids_np) == len(seqs) and self.graphs.can_run(len(seqs)):
            hidden = self.graphs.run(
                ids_np,
                host["positions"],
                host["slots"],
                host["tables"],
                host["context_lens"],
                pending=self._pending_tensors(pending, prev),
            )
        else:
            positions, meta = self._device_metadata(host)
            ids = torch.from_numpy(ids_np).to(self.device, non_blocking=True)
            if pending is not None:
                dst, values = self._pending_tensors(pending, prev)
                ids.index_copy_(0, dst, values)
            hidden = self.model(ids, positions, meta)
        if not sampling_rows:
            return StepHandle(outputs=[])
        last = np.cumsum(batch.num_scheduled_tokens) - 1
        # A plain torch.tensor(..., device=cuda) would wait for the device: copy asynchronously.
        logits_indices = torch.from_numpy(last[sampling_rows]).to(self.device, non_blocking=True)
        logits = self.model.compute_logits(hidden[logits_indices]).float()
        sampled_seqs = [seqs[i] for i in sampling_rows]
        if needs_sample_outputs(sampled_seqs):
            outputs = sample_sequences(logits, sampled_seqs, eos_token_ids)
            return StepHandle(outputs=outputs)
        mask_early_stops(logits, sampled_seqs, eos_token_ids)
        tokens = sample(logits, self._sampling_tensors(sampled_seqs)).token_ids
        return StepHandle.copy_to_host(tokens)

    @staticmethod
    def _pending_inputs(
        seqs: list[Sequence], cu_seqlens_q: np.ndarray, prev: StepHandle | None
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """(input positions, rows of prev's samples) of the placeholder tokens, if any."""
        rows = [(int(cu_seqlens_q[i + 1]) - 1, s.pending_row) for i, s in enumerate(seqs)
                if s.pending_row is not None]  # fmt: skip
        if not rows:
            return None
        assert prev is not None and prev.tokens is not None
        dst, src = np.asarray(rows, dtype=np.int64).T
        return dst, src

    def _pending_tensors(
        self, pending: tuple[np.ndarray, np.ndarray] | None, prev: StepHandle | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if pending is None:
            return None
        dst = torch.from_numpy(pending[0]).to(self.device, non_blocking=True)
        src = torch.from_numpy(pending[1]).to(self.device, non_blocking=True)
        return dst, prev.tokens.index_select(0, src)
