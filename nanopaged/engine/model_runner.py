"""Owns the model and the KV tensor; turns a ScheduledBatch into sampled tokens."""

from __future__ import annotations

import gc
import logging
import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from nanopaged.attention import Attention, AttentionMetadata, attention_backend
from nanopaged.config import EngineConfig, ModelConfig
from nanopaged.distributed.parallel import TensorParallel, local_kv_heads
from nanopaged.distributed.sharded_sampling import can_shard, sample_shards, settings_array
from nanopaged.engine.block_tables import BlockTableBuilder
from nanopaged.engine.cuda_graph import DecodeGraphs
from nanopaged.engine.host_memory import keep_freed_memory
from nanopaged.engine.penalty_counts import PenaltyCounts
from nanopaged.engine.prompt_logprobs import (
    PROFILE_TOPK,
    PromptLogprobRows,
    PromptScores,
    rows_per_chunk,
    score_prompt_rows,
)
from nanopaged.engine.sample_output import (
    DeviceSamples,
    SampleOutput,
    StepLogprobs,
    check_finite,
)
from nanopaged.engine.sampling import (
    SlotSettings,
    mask_early_stops,
    needs_sample_outputs,
    penalize,
    row_stream,
    sample_sequences,
    sampling_tensors,
)
from nanopaged.engine.scheduler import ScheduledBatch
from nanopaged.engine.sequence import Sequence
from nanopaged.engine.step_inputs import StepInputs
from nanopaged.engine.swap import allocate_cpu_kv_cache, copy_block_pairs, run_block_ops
from nanopaged.kernels.store_kv import is_fp8
from nanopaged.layers.sampler import SAMPLER_PATHS, SamplingTensors, sample, with_path
from nanopaged.loader import load_dummy_weights, load_weights
from nanopaged.models import build_model
from nanopaged.models.llama import checkpoint_shapes

if TYPE_CHECKING:
    from nanopaged.distributed.workers import TPWorkers

logger = logging.getLogger(__name__)


class StepHandle:
    """A launched step's samples: on the device, copying to the host, or already there.

    A plain step's raw logprobs (for the rows that asked for them) come back the same way, in
    the same asynchronous copy as its tokens; so do the prompt logprobs of the prompt rows it
    scored (prompt), and each row's sampled logit, which result() checks before it hands out a
    token (NonFiniteLogitsError).
    """

    def __init__(self, outputs: list | None = None) -> None:
        self.outputs = outputs
        self.prompt: PromptScores | None = None
        self.tokens: torch.Tensor | None = None  # [num_sampled] int64 on the device
        # The sequence of each sampled row: names the requests of rows that fail the check.
        self.seqs: list[Sequence] | None = None
        self._host: list[torch.Tensor] = []
        self._sampled_logits: torch.Tensor | None = None  # [num_sampled] on the host
        # [num_sampled] bool on the host, whether finite logits decided each row's token
        # (None: not known yet, or checked and all finite).
        self._finite: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        self._logprob_widths: list[int | None] | None = None
        self._logprobs: StepLogprobs | None = None

    @classmethod
    def copy_to_host(
        cls,
        tokens: torch.Tensor,
        logprobs: tuple[torch.Tensor, ...] | None = None,
        widths: list[int | None] | None = None,
        sampled_logits: torch.Tensor | None = None,
    ) -> StepHandle:
        """tokens: [rows]; logprobs: (sampled [rows], top values [rows, k], top ids [rows, k],
        sampled token's rank [rows]); widths: per row, the top-k it asked for (None: none);
        sampled_logits: [rows], see DeviceSamples (None: nothing to check)."""
        handle = cls()
        handle.tokens = tokens
        handle._logprob_widths = widths
        tensors = [tokens, *(logprobs or ())]
        if sampled_logits is not None:
            tensors.append(sampled_logits)
        if tokens.is_cuda:
            host = []
            for t in tensors:
                host.append(torch.empty(t.shape, dtype=t.dtype, pin_memory=True))
                host[-1].copy_(t, non_blocking=True)
            handle._event = torch.cuda.Event()
            handle._event.record()
        else:
            host = tensors
        if sampled_logits is not None:
            handle._sampled_logits = host.pop()
        handle._host = host
        return handle

    @classmethod
    def of_outputs(cls, outputs: list[SampleOutput]) -> StepHandle:
        """A step sampled on the host already (sample_sequences): its outputs, checked as
        the device's samples are (SampleOutput.finite)."""
        handle = cls(outputs)
        handle._finite = torch.tensor([out.finite for out in outputs], dtype=torch.bool)
        return handle

    @property
    def plain(self) -> bool:
        """Bare token ids (not SampleOutputs), kept on the device for the next step."""
        return self.tokens is not None

    def result(self) -> list[int] | list[SampleOutput]:
        """The samples, waiting for the device if needed. Raises NonFiniteLogitsError, at
        every call, when NaN or infinite logits decided the token of a row that is to be
        appended (read only now: a sequence that finished meanwhile drops its row)."""
        if self.outputs is None:
            if self._event is not None:
                self._event.synchronize()
            if self._sampled_logits is not None:
                self._finite = torch.isfinite(self._sampled_logits)
            self.outputs = self._host[0].tolist()
        if self._finite is not None:
            check_finite(self._finite, self.seqs)
            self._finite = None
        return self.outputs

    def logprobs(self) -> StepLogprobs | None:
        """The raw logprobs of a plain step's sampled rows, kept whole as host arrays for the
        rows to refer to; None when no row asked for them."""
        if self._logprob_widths is None:
            return None
        if self._logprobs is None:
            tokens = self.result()
            picked, top_v, top_i, ranks = self._host[1:]
            # Copies: pinned buffers go back to their pool; a CPU step's may be views of more.
            self._logprobs = StepLogprobs(
                tokens,
                picked.tolist(),
                top_v.numpy().copy(),
                top_i.numpy().copy(),
                ranks.numpy().copy(),
                self._logprob_widths,
            )
        return self._logprobs

    def prompt_logprobs(self) -> PromptLogprobRows | None:
        """The prompt logprobs of the step's prompt rows on the host, in the order of its
        ScheduledBatch.prompt_logprob_spans; None when it scored none."""
        return None if self.prompt is None else self.prompt.rows()


def _is_arange(a: np.ndarray, n: int) -> bool:
    """Whether a is [0, 1, ..., n - 1]."""
    if len(a) != n:
        return False
    return n == 0 or (a[0] == 0 and a[-1] == n - 1 and bool((a == np.arange(n)).all()))


def kv_bytes_per_block(
    model_config: ModelConfig, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None
) -> int:
    """Bytes of one KV block: K and V of block_size tokens in every layer (of num_kv_heads
    heads: a tensor-parallel rank's share; all of the model's by default)."""
    c = model_config
    elem = torch.empty((), dtype=dtype).element_size()
    heads = c.num_kv_heads if num_kv_heads is None else num_kv_heads
    return 2 * c.num_layers * block_size * heads * c.head_dim * elem


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """A host tensor in page-locked memory when CUDA is there: a copy from pageable memory
    would wait for the device to finish its queued work (stalling asynchronous steps)."""
    return t.pin_memory() if torch.cuda.is_available() else t


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
        load_format: str = "auto",
        tp: TensorParallel | None = None,
        workers: TPWorkers | None = None,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        """tp: this rank's share under tensor parallelism; workers (rank 0 only): the other
        ranks, which run every step this runner launches; kv_cache_dtype: the KV tensor's
        dtype (default: dtype; fp8 e4m3/e5m2 stores K/V in 8 bits with per-layer scales)."""
        self.model_config = model_config
        self.tp = tp or TensorParallel()
        self.tp.enable_peer_all_reduce(device)  # collective, before the KV budget is set
        self.workers = workers
        self.num_kv_heads, _ = local_kv_heads(model_config.num_kv_heads, self.tp)
        self.config = engine_config
        self.max_model_len = max_model_len
        self.device = device
        self.dtype = dtype
        self.kv_cache_dtype = dtype if kv_cache_dtype is None else kv_cache_dtype
        self.block_size = engine_config.block_size
        # Penalized sequences' token counts, kept on the device across steps (made on first use).
        self.penalty_counts: PenaltyCounts | None = None
        torch.manual_seed(engine_config.seed)
        if device.type == "cpu":
            keep_freed_memory()  # a CPU step's activations reuse heap blocks, no page faults
        # A budget the config fixes is checked before anything is loaded.
        profile = device.type == "cuda" and engine_config.kv_cache_memory is None
        if not profile:
            budget = engine_config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY
            self.num_blocks = self._blocks_for_budget(budget)
        with torch.device(device):
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                self.model = build_model(model_config, self.tp)
            finally:
                torch.set_default_dtype(default_dtype)
        if load_format == "dummy":
            load_dummy_weights(self.model, checkpoint_shapes(model_config), engine_config.seed)
        else:
            load_weights(self.model, model_dir)
        self.model.eval()
        # Triton kernels on CUDA; on CPU the torch references, or C kernels for bf16: chosen
        # here, once, and bound to every layer (CPU bf16: GEMM weights packed for oneDNN).
        self.backend = attention_backend(device, dtype)
        self.backend.bind(self.model)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        # kv_scales: [2, num_layers] fp32, K and V scale of each layer (an fp8 cache holds
        # x / scale). 1.0 unless the checkpoint has its own (model.checkpoint_kv_scales) or
        # calculate_kv_scales asks for them from the first forward pass. Measured on SmolLM2,
        # scales calibrated from activations agreed no better with full precision than 1.0
        # (benchmarks/fp8_accuracy.py); they matter for K/V beyond the format's range. The
        # kernels read them from the device, so CUDA graphs follow any later change. Under
        # tensor parallelism each rank holds its own (calculated: from its own heads).
        # first_kv_pass: what the first forward pass over an 8-bit cache does before storing
        # (see execute): "calculate" the scales, or "check" that K/V fit under the scales
        # (kv_peaks: [2, num_layers], largest |K| / k_scale and |V| / v_scale), warning once
        # when they pass the format's largest value; None once it ran.
        self.kv_scales: torch.Tensor | None = None
        self.kv_peaks: torch.Tensor | None = None
        self.first_kv_pass: str | None = None
        if is_fp8(self.kv_cache_dtype):
            layers = len(self.attention_layers)
            self.kv_scales = torch.ones(2, layers, dtype=torch.float32, device=device)
            self.kv_peaks = torch.zeros(2, layers, dtype=torch.float32, device=device)
            if not engine_config.calculate_kv_scales:
                for i, parts in getattr(self.model, "checkpoint_kv_scales", {}).items():
                    for row, part in enumerate("kv"):
                        if part in parts:
                            self.kv_scales[row, i] = parts[part]
            for i, layer in enumerate(self.attention_layers):
                layer.k_scale = self.kv_scales[0, i : i + 1]
                layer.v_scale = self.kv_scales[1, i : i + 1]
                layer.kv_peak = self.kv_peaks[:, i]
        if profile:
            self.num_blocks = self._blocks_for_budget(self._profile_cuda_budget())
        # Every rank must hold the same block ids: the smallest count any rank can fit.
        self.num_blocks = self.tp.min_over_ranks(self.num_blocks)
        # kv_cache: [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]. Zeroed:
        # a slot no step wrote yet must not be NaN (a kernel weighing a stale slot by 0 would
        # still get NaN); zero_blocks keeps it so after NaN logits.
        self.kv_cache = torch.zeros(
            2,
            model_config.num_layers,
            self.num_blocks,
            self.block_size,
            self.num_kv_heads,
            model_config.head_dim,
            dtype=self.kv_cache_dtype,
            device=device,
        )
        self.bind_kv(self.kv_cache)
        self._tables = BlockTableBuilder()
        # The CPU swap pool (preemption_mode="swap"), see allocate_swap_space.
        self.cpu_kv_cache: torch.Tensor | None = None
        self._sampling_cache: tuple[tuple[int, ...], SamplingTensors, list[int]] | None = None
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
                # One GPU: the LM head and the sampler inside the graphs too.
                lm_head=self.model.compute_logits if self.tp.size == 1 else None,
                backend=self.backend,
            )
            self.graphs.capture()
        if device.type == "cuda" and self.tp.rank == 0:
            self._warm_up_sampler()
        if device.type == "cuda" and self.num_blocks > 1:
            # The copy-on-write kernel too (the first fork of n > 1 or a beam would compile it
            # mid-run): block 0 onto block 1, before any block holds a token.
            copy_block_pairs(self.kv_cache, [(0, 1)])
        # Set last: nothing above (profiling, graph capture, warm-ups) is the first pass.
        if self.kv_scales is not None:
            self.first_kv_pass = "calculate" if engine_config.calculate_kv_scales else "check"
        if workers is not None:
            # Weakly: a strong reference back to the runner would make the pair a cycle, which
            # only the garbage collector frees, keeping a dropped LLM's KV cache alive until a
            # full collection (which a run holds off).
            workers.before_leave = weakref.WeakMethod(self.release_graphs)

    def release_graphs(self) -> None:
        """Drop the captured decode graphs once the device is idle; under tensor parallelism
        they hold NCCL work, so they must be gone before the process group is."""
        if self.graphs is None:
            return
        torch.cuda.synchronize(self.device)
        self.graphs = None
        gc.collect()

    def bind_kv(self, cache: torch.Tensor) -> None:
        """Point each attention layer at its K and V in cache ([2, num_layers, num_blocks,
        block_size, num_kv_heads, head_dim], contiguous). An 8-bit V is kept channel-major
        (store_kv.channel_major), the order the decode kernel reads it in; block copies and
        swaps move whole blocks, so they do not depend on it."""
        self.backend.bind_kv(self.attention_layers, cache)

    def zero_blocks(self, block_ids: list[int]) -> None:
        """Zero these KV blocks on every rank: after NaN logits their K/V may be NaN, and a
        kernel that weighs a stale slot by 0 (a block's unused tail) would still get NaN."""
        if self.workers is not None and self.workers.alive:
            self.workers.zero_blocks(block_ids)
        if block_ids:
            ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
            self.kv_cache.index_fill_(2, ids, 0)  # [2, layers, blocks, ...]

    def allocate_swap_space(self, num_blocks: int) -> None:
        """Allocate the CPU swap pool: num_blocks blocks shaped like the device cache's."""
        if self.workers is not None:
            self.workers.allocate_swap_space(num_blocks)
        self.cpu_kv_cache = allocate_cpu_kv_cache(self.kv_cache, num_blocks)

    # ---- sizing --------------------------------------------------------------------------
    @property
    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(
            self.model_config, self.block_size, self.kv_cache_dtype, self.num_kv_heads
        )

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
        prefill step with its prompt-logprob chunk and its sampling (every sampling option on),
        and what CUDA graphs of decode steps will hold."""
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
            2, c.num_layers, sum(blocks), self.block_size, self.num_kv_heads, c.head_dim,
            dtype=self.kv_cache_dtype, device=self.device,
        )
        self.bind_kv(scratch)
        firsts = np.cumsum([0] + blocks[:-1])
        tables = [list(range(f, f + b)) for f, b in zip(firsts, blocks)]
        positions, meta = self._metadata(lens, [0] * len(lens), tables)
        input_ids = torch.zeros(total, dtype=torch.long, device=self.device)
        rows = min(self.config.max_num_seqs, total)
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, meta)
            # A chunk of prompt rows scored for prompt_logprobs, as execute does beside them.
            probe = np.arange(min(total, rows_per_chunk(c.vocab_size, PROFILE_TOPK)))
            score_prompt_rows(self.model.compute_logits, hidden, probe, np.zeros_like(probe),
                              np.full_like(probe, PROFILE_TOPK), c.vocab_size)  # fmt: skip
            logits = self.model.compute_logits(hidden[:rows])  # None on ranks other than 0
            if logits is not None:
                self._profile_sampling(logits.float())
            del logits
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
                hidden = self.model(ids, positions, meta)
                if self.tp.size == 1:  # the captured samplers' logits and scratch too
                    logits = self.model.compute_logits(hidden)
                    st = self._profile_sampling(logits, num_logprobs=0)
                    sample(logits, with_path(st, "frontier"))
                    del logits
                del hidden
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

    def _warm_up_sampler(self) -> None:
        """Compile the sampler kernel's three variants (plain; the sampled tokens' logprobs;
        top logprobs too) and every path of SAMPLER_PATHS (the greedy argmax, the chunked
        draws) now, not inside the first steps that ask for them: a compile there stalls every
        running request. Batch sizes and logprob counts compile none."""
        vocab = self.model_config.vocab_size
        logits = torch.zeros(3, vocab, dtype=self.dtype, device=self.device)
        self._profile_sampling(logits, num_logprobs=0)
        st = self._profile_sampling(logits, num_logprobs=1)
        sample(logits, st, need_logprobs=True)
        for path in SAMPLER_PATHS:  # each path without logprobs; greedy: the argmax kernels
            sample(logits, with_path(st, path))
        torch.cuda.synchronize()

    def _profile_sampling(self, logits: torch.Tensor, num_logprobs: int = 20) -> SamplingTensors:
        """Run the sampler's most memory-hungry path over logits rows: [rows, vocab]."""
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
        num_logprobs = min(num_logprobs, vocab)
        sample(logits, st, num_logprobs=num_logprobs)
        if num_logprobs:
            logits.log_softmax(-1).topk(num_logprobs, dim=-1)
        return st

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
        """The step's positions and metadata on the device, as the backend prepares them."""
        return self.backend.prepare_metadata(host, self.device)

    def _sampling_tensors(
        self, seqs: list[Sequence], into: SlotSettings | None = None
    ) -> SamplingTensors:
        """Per-row settings, kept on the device while consecutive steps sample the same
        sequences: then each row's offset (its output position) just moves on by one, on the
        device, with no copy from the host. into: in the decode graphs' persistent settings."""
        offsets = [s.num_output_tokens for s in seqs]
        key = (tuple(s.seq_id for s in seqs), into is not None)
        cached = self._sampling_cache
        if cached is not None and cached[0] == key:
            _, st, last = cached
            if not st.all_greedy and offsets != last:
                if all(o == p + 1 for o, p in zip(offsets, last)):
                    st.offsets.add_(1)
                else:
                    host = torch.tensor(offsets, dtype=torch.int64)
                    st.offsets.copy_(_pinned(host), non_blocking=True)
            self._sampling_cache = (key, st, offsets)
            return st
        params = [s.sampling_params for s in seqs]
        st = sampling_tensors(params, [row_stream(s) for s in seqs], offsets, self.device, into)
        self._sampling_cache = (key, st, offsets)
        return st

    def _graph_decode(self, step: StepInputs) -> bool:
        """Whether the step's forward replays a decode graph: one token per sequence, in a
        batch no larger than the largest bucket."""
        batch_size = len(step.context_lens)
        return (
            self.graphs is not None
            and self.first_kv_pass is None  # the first pass over an 8-bit cache is eager
            and len(step.input_ids) == batch_size
            and self.graphs.can_run(batch_size)
        )

    def _graph_sampling(self, step: StepInputs, seqs: list[Sequence]) -> SamplingTensors | None:
        """The settings to sample the step inside its decode graph, or None when it samples
        outside: the one place that decides. Inside: every row of a graph-replayed decode
        step samples one plain token (no logprobs, penalties, logit controls, min_tokens
        masking, fork or beam: needs_sample_outputs), on one GPU, and no prompt row is scored
        (its hidden state must leave the graph)."""
        graphs = self.graphs
        if graphs is None or not graphs.can_sample or not self._graph_decode(step):
            return None
        if len(step.prompt_rows):
            return None
        if not _is_arange(step.logits_indices, len(step.context_lens)):
            return None
        for seq in seqs:
            p = seq.sampling_params
            if p.logprobs is not None or p.has_penalties or seq.num_output_tokens < p.min_tokens:
                return None
        if needs_sample_outputs(seqs):
            return None
        return self._sampling_tensors(seqs, graphs.slots)

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

        Sequences whose newest token is still pending take it from `prev`'s sampled tokens on the
        device (asynchronous scheduling).
        """
        seqs = batch.seqs
        step = self._step_inputs(batch)
        if self.workers is not None:
            self.workers.publish(step)  # tensor parallel: every rank runs the same step
        sampled_seqs = [seqs[i] for i in range(len(seqs)) if batch.samples(i)]
        in_graph = self._graph_sampling(step, sampled_seqs)
        logits, prompt = self.execute(step, prev, in_graph)
        if self.workers is not None:
            self.workers.step_done()
        handle = self._sampled(logits, sampled_seqs, prev, eos_token_ids)
        handle.prompt = prompt
        handle.seqs = sampled_seqs
        return handle

    def _sampled(
        self,
        logits: torch.Tensor | DeviceSamples | None,
        sampled_seqs: list[Sequence],
        prev: StepHandle | None,
        eos_token_ids: set[int],
    ) -> StepHandle:
        """The step's samples from execute's logits rows (or its tokens, sampled already).

        Every path brings back with each row's token whether finite logits decided it (its
        sampled logit: DeviceSamples; SampleOutput.finite), checked where the step's samples
        are read (StepHandle.result)."""
        if logits is None:
            return StepHandle(outputs=[])
        if isinstance(logits, DeviceSamples):  # sampled in the decode graph or in shards
            return StepHandle.copy_to_host(logits.token_ids,
                                           sampled_logits=logits.sampled_logits)  # fmt: skip
        pending = None if prev is None else prev.tokens
        counts = None
        if any(s.sampling_params.has_penalties for s in sampled_seqs):
            if self.penalty_counts is None:
                self.penalty_counts = PenaltyCounts(logits.shape[-1], logits.device)
            counts = self.penalty_counts
        if needs_sample_outputs(sampled_seqs):
            outputs = sample_sequences(logits.float(), sampled_seqs, eos_token_ids, pending,
                                       counts)  # fmt: skip
            return StepHandle.of_outputs(outputs)
        if counts is not None:
            # Penalized rows stay plain (asynchronous): their counts take a pending token
            # from the previous step's samples on the device.
            logits = penalize(logits.float(), sampled_seqs, pending, counts)
        mask_early_stops(logits, sampled_seqs, eos_token_ids)
        widths = [s.sampling_params.logprobs for s in sampled_seqs]
        if all(w is None for w in widths):
            tokens = sample(logits, self._sampling_tensors(sampled_seqs)).token_ids
            picked = logits.gather(1, tokens[:, None])[:, 0]
            return StepHandle.copy_to_host(tokens, sampled_logits=picked)
        # Raw logprobs in the same pass; no row here is masked (see needs_sample_outputs).
        k = min(max(w or 0 for w in widths), logits.shape[-1])
        out = sample(logits, self._sampling_tensors(sampled_seqs), k, need_logprobs=True)
        picked = logits.gather(1, out.token_ids[:, None])
        ranks = (logits > picked).sum(dim=-1) + 1  # 1-based rank of the sampled token
        top_v = out.top_logprobs if k else out.logprobs[:, None][:, :0]
        top_i = out.top_token_ids if k else out.token_ids[:, None][:, :0]
        logprobs = (out.logprobs, top_v, top_i, ranks)
        return StepHandle.copy_to_host(out.token_ids, logprobs, widths, picked[:, 0])

    def _step_inputs(self, batch: ScheduledBatch) -> StepInputs:
        """The step's host arrays, built from the batch's sequences."""
        seqs = batch.seqs
        starts = [s.num_computed_tokens for s in seqs]
        input_ids: list[int] = []
        for seq, start, n in zip(seqs, starts, batch.num_scheduled_tokens):
            input_ids.extend(seq.token_ids[start : start + n])
            if start + n > len(seq.token_ids):
                input_ids.append(0)  # a sample still on the device, copied in there
        host = self._host_arrays(batch.num_scheduled_tokens, starts, self._tables.build(seqs))
        sampling_rows = [i for i in range(len(seqs)) if batch.samples(i)]
        last = np.cumsum(batch.num_scheduled_tokens) - 1
        ids_np = np.asarray(input_ids, dtype=np.int64)
        pending_dst, pending_src = self._pending_inputs(seqs, host["cu_seqlens_q"])
        prompt = {} if not batch.prompt_logprob_spans else self._prompt_rows(
            batch, starts, host["cu_seqlens_q"]
        )
        settings = None
        if self.tp.size > 1:
            sampled_seqs = [seqs[i] for i in sampling_rows]
            if can_shard(sampled_seqs):
                settings = settings_array(sampled_seqs)
        return StepInputs(
            input_ids=ids_np,
            positions=host["positions"],
            slots=host["slots"],
            tables=host["tables"],
            context_lens=host["context_lens"],
            cu_seqlens_q=host["cu_seqlens_q"],
            logits_indices=last[sampling_rows].astype(np.int64),
            blocks_to_swap_out=batch.blocks_to_swap_out,
            blocks_to_swap_in=batch.blocks_to_swap_in,
            blocks_to_copy=batch.blocks_to_copy,
            pending_dst=pending_dst,
            pending_src=pending_src,
            **({} if settings is None else dict(sample_settings=settings)),
            **prompt,
        )

    @staticmethod
    def _prompt_rows(
        batch: ScheduledBatch, starts: list[int], cu_seqlens_q: np.ndarray
    ) -> dict[str, np.ndarray]:
        """StepInputs' prompt rows, from the batch's prompt_logprob_spans: the step's input
        rows of those positions, the prompt tokens they predict, the top-k each asked for."""
        rows, targets, topk = [], [], []
        for i, first, end in batch.prompt_logprob_spans:
            seq = batch.seqs[i]
            at = int(cu_seqlens_q[i]) + first - starts[i]
            rows.append(np.arange(at, at + end - first, dtype=np.int64))
            targets.append(np.asarray(seq.token_ids[first + 1 : end + 1], dtype=np.int64))
            topk.append(np.full(end - first, seq.sampling_params.prompt_logprobs, np.int64))
        return dict(prompt_rows=np.concatenate(rows), prompt_targets=np.concatenate(targets),
                    prompt_topk=np.concatenate(topk))  # fmt: skip

    @torch.inference_mode()
    def execute(
        self, step: StepInputs, prev: StepHandle | None, sampling: SamplingTensors | None = None
    ) -> tuple[torch.Tensor | DeviceSamples | None, PromptScores | None]:
        """Block ops and the forward pass of one step, then its prompt rows scored (every rank
        takes part). On rank 0: its logits rows to sample ([rows, vocab] in the model's dtype:
        the sampler reads them as they are, and bf16/fp16 -> fp32 is exact), or the rows'
        samples when step.samples_sharded or with sampling (from _graph_sampling: sampled
        inside the decode graph), None when nothing samples; and the prompt rows' results
        (None without any). Other ranks get (None, None)."""
        # Swaps and copy-on-write copies go before the forward (and outside any CUDA graph).
        run_block_ops(
            self.kv_cache,
            self.cpu_kv_cache,
            step.blocks_to_swap_out,
            step.blocks_to_swap_in,
            step.blocks_to_copy,
        )
        pending = self._pending_tensors(step, prev)
        if self._graph_decode(step):
            out = self.graphs.run(
                step.input_ids,
                step.positions,
                step.slots,
                step.tables,
                step.context_lens,
                pending=pending,
                sampling=sampling,
            )
            if isinstance(out, DeviceSamples):
                return out, None  # sampled in the graph; no prompt row (see _graph_sampling)
            hidden = out
        else:
            positions, meta = self._device_metadata(
                dict(positions=step.positions, slots=step.slots, tables=step.tables,
                     context_lens=step.context_lens, cu_seqlens_q=step.cu_seqlens_q)
            )  # fmt: skip
            # An 8-bit cache's first forward pass sets or checks the scales before it stores
            # (a pass that raised, e.g. interrupted, is the first pass again next step).
            meta.first_kv_pass = self.first_kv_pass
            if pending is not None and pending[0] is None:
                ids = pending[1]  # every input id is a pending sample, in its row
            else:
                ids = torch.from_numpy(step.input_ids).to(self.device, non_blocking=True)
                if pending is not None:
                    ids.index_copy_(0, *pending)
            hidden = self.model(ids, positions, meta)
            self.first_kv_pass = None
            if meta.first_kv_pass == "check":
                self._warn_past_kv_range()
        prompt = score_prompt_rows(self.model.compute_logits, hidden, step.prompt_rows,
                                   step.prompt_targets, step.prompt_topk,
                                   self.model_config.vocab_size)  # fmt: skip
        if not len(step.logits_indices):
            return None, prompt
        if not _is_arange(step.logits_indices, len(hidden)):  # else every row samples, in order
            # A plain torch.tensor(..., device=cuda) would wait for the device: copy
            # asynchronously.
            rows = torch.from_numpy(step.logits_indices).to(self.device, non_blocking=True)
            hidden = hidden.index_select(0, rows)
        if step.samples_sharded:
            local, vocab_start = self.model.compute_local_logits(hidden)
            return sample_shards(local, vocab_start, step.sample_settings, self.tp), prompt
        return self.model.compute_logits(hidden), prompt

    def _warn_past_kv_range(self) -> None:
        """After the first forward pass over an 8-bit cache with fixed scales: warn, once,
        when some layer's K or V passed the format's largest value (store_kv clamps them).
        Reads kv_peaks back: one host sync, on this step only."""
        fmax = torch.finfo(self.kv_cache_dtype).max
        peaks = self.kv_peaks.cpu()
        past = [f"layer {i} {'KV'[row]} {peaks[row, i].item():.4g}"
                for i, row in sorted((i, row) for row, i in (peaks > fmax).nonzero().tolist())]
        if past:
            name = str(self.kv_cache_dtype).removeprefix("torch.")
            warnings.warn(
                f"the first forward pass stored K/V past {name}'s largest value ({fmax:g}) at "
                f"their scales ({', '.join(past[:4])}{', ...' if len(past) > 4 else ''}): they "
                "are clamped. Use calculate_kv_scales=True, or a checkpoint with KV scales.",
                stacklevel=2,
            )

    @staticmethod
    def _pending_inputs(
        seqs: list[Sequence], cu_seqlens_q: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(input positions, rows of the previous step's samples) of the pending samples."""
        rows = [(int(cu_seqlens_q[i + 1]) - 1, s.pending_row) for i, s in enumerate(seqs)
                if s.pending_row is not None]  # fmt: skip
        pairs = np.asarray(rows, dtype=np.int64).reshape(-1, 2)
        return pairs[:, 0].copy(), pairs[:, 1].copy()

    def _pending_tensors(
        self, step: StepInputs, prev: StepHandle | None
    ) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """(input positions, token ids) on the device for the step's pending samples, if any.
        Positions are None when every input id is pending and comes from the same row of the
        previous step's samples (a steady decode): the ids are then a view of those samples,
        with no index arrays to copy and no gather."""
        n = len(step.pending_dst)
        if not n:
            return None
        if n == len(step.input_ids) and _is_arange(step.pending_dst, n) and _is_arange(
            step.pending_src, n
        ):
            if self.tp.rank == 0:
                assert prev is not None and prev.tokens is not None
                values = prev.tokens[:n]
            else:
                values = torch.empty(n, dtype=torch.long, device=self.device)
            return None, self.tp.broadcast(values)
        dst = torch.from_numpy(step.pending_dst).to(self.device, non_blocking=True)
        if self.tp.rank == 0:
            assert prev is not None and prev.tokens is not None
            src = torch.from_numpy(step.pending_src).to(self.device, non_blocking=True)
            values = prev.tokens.index_select(0, src)
        else:
            values = torch.empty(len(dst), dtype=torch.long, device=self.device)
        # Only rank 0 samples: the other ranks get the sampled ids from it, on the device.
        return dst, self.tp.broadcast(values)
