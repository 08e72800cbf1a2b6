"""Owns the model and the KV tensor; turns a ScheduledBatch into sampled tokens."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from nanopaged.attention import Attention, AttentionMetadata, attention_backend
from nanopaged.config import EngineConfig, ModelConfig
from nanopaged.distributed.parallel import TensorParallel, local_kv_heads
from nanopaged.engine.block_tables import BlockTableBuilder
from nanopaged.engine.cuda_graph import DecodeGraphs
from nanopaged.engine.host_memory import keep_freed_memory
from nanopaged.engine.kv_cache import (
    DEFAULT_CPU_KV_CACHE_MEMORY,
    blocks_for_budget,
    kv_bytes_per_block,
    kv_scales,
    profile_cuda_budget,
    warn_past_kv_range,
)
from nanopaged.engine.scheduler import ScheduledBatch
from nanopaged.engine.sequence import Sequence
from nanopaged.engine.step_inputs import (
    Peers,
    StepInputs,
    as_decode_rows,
    build_step_inputs,
    host_arrays,
    is_arange,
    pending_ids,
)
from nanopaged.engine.swap import allocate_cpu_kv_cache, copy_block_pairs, run_block_ops
from nanopaged.kernels.store_kv import is_fp8
from nanopaged.loader import load_dummy_weights, load_weights
from nanopaged.models import build_model
from nanopaged.models.llama import checkpoint_shapes
from nanopaged.platform import platform_of, synchronize, to_device
from nanopaged.sampling.ops import SamplingTensors
from nanopaged.sampling.output import DeviceSamples, GraphSampler, SampleOutput, StepHandle
from nanopaged.sampling.prompt_logprobs import PromptScores, score_prompt_rows
from nanopaged.sampling.rows import StepRows
from nanopaged.sampling.sampler import Sampler
from nanopaged.sampling.sharded import sample_shards, settings_array


class PreparedStep(NamedTuple):
    """A step's host half (ModelRunner.prepare): its batch, the sequences that sample, their
    rows' needs, and its inputs."""

    batch: ScheduledBatch
    sampled_seqs: list[Sequence]
    rows: StepRows
    step: StepInputs


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
        workers: Peers | None = None,
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
        self.platform = platform_of(device)
        self.dtype = dtype
        self.kv_cache_dtype = dtype if kv_cache_dtype is None else kv_cache_dtype
        self.block_size = engine_config.block_size
        self.sampler = Sampler(model_config.vocab_size, device)
        self._tables = BlockTableBuilder()
        self.cpu_kv_cache: torch.Tensor | None = None  # the swap pool, allocate_swap_space
        self.graphs: DecodeGraphs | None = None
        torch.manual_seed(engine_config.seed)
        if not self.platform.gpu:
            keep_freed_memory()  # a CPU step's activations reuse heap blocks, no page faults
        # A budget the config fixes is checked before anything is loaded.
        profile = self.platform.gpu and engine_config.kv_cache_memory is None
        if not profile:
            budget = engine_config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY
            self.num_blocks = self._blocks_for_budget(budget)
        self._load_model(model_dir, load_format)
        if profile:
            self.num_blocks = self._blocks_for_budget(profile_cuda_budget(self))
        # Every rank must hold the same block ids: the smallest count any rank can fit.
        self.num_blocks = self.tp.min_over_ranks(self.num_blocks)
        # kv_cache: [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]. Zeroed:
        # a slot no step wrote yet must not be NaN (a kernel weighing a stale slot by 0 would
        # still get NaN); zero_blocks keeps it so after NaN logits.
        c = model_config
        self.kv_cache = torch.zeros(
            2, c.num_layers, self.num_blocks, self.block_size, self.num_kv_heads, c.head_dim,
            dtype=self.kv_cache_dtype, device=device,
        )  # fmt: skip
        self.bind_kv(self.kv_cache)
        if self.platform.gpu:
            self._compile_ahead()
        # Set last: nothing above (profiling, graph capture, warm-ups) is the first pass.
        if self.kv_scales is not None:
            self.first_kv_pass = "calculate" if engine_config.calculate_kv_scales else "check"
        if workers is not None:
            # Weakly: a strong reference back to the runner would make the pair a cycle, which
            # only the garbage collector frees, keeping a dropped LLM's KV cache alive until a
            # full collection (which a run holds off).
            workers.before_leave = weakref.WeakMethod(self.release_graphs)

    def _load_model(self, model_dir: Path, load_format: str) -> None:
        """Build the model in the run dtype, load its weights, bind the compute backend and
        set up an 8-bit cache's scales."""
        with torch.device(self.device):
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            try:
                self.model = build_model(self.model_config, self.tp)
            finally:
                torch.set_default_dtype(default_dtype)
        if load_format == "dummy":
            load_dummy_weights(self.model, checkpoint_shapes(self.model_config), self.config.seed)
        else:
            load_weights(self.model, model_dir)
        self.model.eval()
        # Triton kernels on CUDA; on CPU the torch references, or C kernels for bf16: chosen
        # here, once, and bound to every layer (CPU bf16: GEMM weights packed for oneDNN).
        self.backend = attention_backend(self.device, self.dtype)
        self.backend.bind(self.model)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        # An 8-bit cache's scales and first-pass peaks (kv_cache.kv_scales). first_kv_pass:
        # what the first forward pass over it does before storing (see execute): "calculate"
        # the scales, or "check" that K/V fit under them, warning once when they pass the
        # format's largest value; None once it ran.
        self.kv_scales: torch.Tensor | None = None
        self.kv_peaks: torch.Tensor | None = None
        self.first_kv_pass: str | None = None
        if is_fp8(self.kv_cache_dtype):
            own = getattr(self.model, "checkpoint_kv_scales", {})
            if self.config.calculate_kv_scales:
                own = {}
            self.kv_scales, self.kv_peaks = kv_scales(self.attention_layers, self.device, own)

    def _compile_ahead(self) -> None:
        """Capture the decode graphs and compile every kernel a run can ask for now, not
        inside the first steps that need them (a compile there stalls every running request)."""
        if not self.config.enforce_eager:
            self.graphs = DecodeGraphs(
                self.model, self.config.max_num_seqs, self.max_model_len, self.block_size,
                self.model_config.hidden_size, self.dtype, self.device,
                # One GPU: the LM head and the sampler inside the graphs too.
                lm_head=self.model.compute_logits if self.tp.size == 1 else None,
                vocab_size=self.model_config.vocab_size, backend=self.backend,
            )  # fmt: skip
            self.graphs.capture()
        if self.tp.rank == 0:
            self.sampler.warm_up(self.dtype)
        if self.platform.gpu:
            self._compile_prefill()
            self.backend.compile_ahead(self.attention_layers[0], self.dtype)
        if self.num_blocks > 1:
            # The copy-on-write kernel (the first fork of n > 1 or a beam would compile it
            # mid-run): block 0 onto block 1, before any block holds a token.
            copy_block_pairs(self.kv_cache, [(0, 1)])
        synchronize(self.device)

    def _compile_prefill(self) -> None:
        """Run eager forward passes over dummy prompts, so the prefill kernel's variants are
        compiled now (a fresh machine's first generate compiled three of them and took 1.18x
        the second): fresh prompts, chunks after a cached prefix and a mixed step's decode
        row, at both of prefill_config's tiles (queries up to 512 tokens, and longer). Every
        rank runs the same passes; the blocks they wrote are zeroed after."""
        # (query tokens, cached tokens) of each sequence
        cases = [([5, 17], [0, 0]), ([1, 17], [40, 30]), ([520], [0]), ([520], [16])]
        used, none = set(), np.zeros(0, dtype=np.int64)
        for q_lens, cached in cases:
            longest = max(q + c for q, c in zip(q_lens, cached))
            if longest > self.max_model_len or sum(q_lens) > self.config.max_num_batched_tokens:
                continue  # a step this engine never runs
            width = -(-longest // self.block_size)
            tables = np.arange(len(q_lens) * width, dtype=np.int32).reshape(len(q_lens), width)
            tables %= self.num_blocks
            used.update(tables.ravel().tolist())
            host = host_arrays(q_lens, cached, tables, self.block_size)
            ids = np.zeros(len(host["positions"]), dtype=np.int64)
            step = StepInputs(input_ids=ids, **host, logits_indices=none, blocks_to_swap_out=[],
                              blocks_to_swap_in=[], blocks_to_copy=[], pending_dst=none,
                              pending_src=none)  # fmt: skip
            self._forward_eager(step, None)
        self._zero(sorted(used))

    def release_graphs(self) -> None:
        """Drop the captured decode graphs once the device is idle; under tensor parallelism
        they hold NCCL work, so they must be gone before the process group is."""
        if self.graphs is None:
            return
        synchronize(self.device)
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
        self._zero(block_ids)

    def _zero(self, block_ids: list[int]) -> None:
        """Zero these blocks of this rank's cache ([2, layers, blocks, ...]); an 8-bit cache
        as bytes (CUDA has no index_fill_ for float8, and 0.0 is the zero byte)."""
        if not block_ids:
            return
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        cache = self.kv_cache
        if cache.element_size() == 1:
            cache = cache.view(torch.uint8)
        cache.index_fill_(2, ids, 0)

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
        knobs = "kv_cache_memory" + (" or gpu_memory_utilization" if self.platform.gpu else "")
        cfg = self.config
        return blocks_for_budget(budget, self.kv_bytes_per_block, self.block_size,
                                 self.max_model_len, cfg.max_num_seqs, knobs)  # fmt: skip

    # ---- one step ------------------------------------------------------------------------
    def _metadata(
        self, num_scheduled: list[int], starts: list[int], block_tables: list[list[int]]
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """Positions of the scheduled tokens and the metadata to find them in the cache."""
        tables = np.zeros((len(block_tables), max(map(len, block_tables))), dtype=np.int32)
        for i, t in enumerate(block_tables):
            tables[i, : len(t)] = t
        return self._device_metadata(host_arrays(num_scheduled, starts, tables, self.block_size))

    def _device_metadata(
        self, host: dict[str, np.ndarray]
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """The step's positions and metadata on the device, as the backend prepares them."""
        return self.backend.prepare_metadata(host, self.device)

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

    def _verifies_in_graph(self, batch: ScheduledBatch, step: StepInputs) -> bool:
        """Whether a step with drafts runs as one-token decode rows (as_decode_rows) through
        a decode graph: every row is a decode row, its last token and its drafts, and the
        step's tokens fit the largest bucket."""
        if not batch.draft_token_ids or self.graphs is None or self.first_kv_pass is not None:
            return False
        return self.graphs.can_run(len(step.input_ids)) and batch.one_token_rows()

    def _graph_sampling(
        self, step: StepInputs, seqs: list[Sequence], rows: StepRows,
        drafts: list[list[int]] | None = None,
    ) -> Callable[[], SamplingTensors] | None:  # fmt: skip
        """What writes the settings to sample the step inside its decode graph (called once the
        forward pass is queued: the device starts while the host writes them), or None when
        it samples outside. Inside: a graph-replayed decode step whose rows are graph_safe
        (StepRows), on one GPU, every row sampling in order, and no prompt row scored (its
        hidden state must leave the graph). A step with drafts (its rows one-token rows,
        as_decode_rows) draws at every verified position there: its drafts are one-hot, so
        those draws are all that verification needs (DraftStepHandle.of_draws)."""
        graphs = self.graphs
        if graphs is None or not graphs.can_sample or not rows.graph_safe:
            return None
        if not self._graph_decode(step) or len(step.prompt_rows):
            return None
        num_rows = len(seqs) + (sum(map(len, drafts)) if drafts else 0)
        if num_rows != len(step.context_lens):
            return None
        if not is_arange(step.logits_indices, num_rows):
            return None
        if drafts:
            return lambda: self.sampler.draft_settings(seqs, drafts, graphs.slots)
        return lambda: self.sampler.settings(seqs, graphs.slots)

    def run(
        self, batch: ScheduledBatch, eos_token_ids: set[int]
    ) -> list[int] | list[SampleOutput]:
        """Compute the batch's scheduled tokens; returns a token for each sequence that samples
        (a SampleOutput each when a fork, a beam, logprobs or penalties are involved)."""
        return self.launch(batch, eos_token_ids).sampled().result()

    def launch(
        self, batch: ScheduledBatch, eos_token_ids: set[int], prev: StepHandle | None = None
    ) -> StepHandle:
        """Queue the batch's forward pass and sampling on the device without waiting for them
        (prepare, then submit)."""
        return self.submit(self.prepare(batch), eos_token_ids, prev)

    def prepare(self, batch: ScheduledBatch) -> PreparedStep:
        """The host half of a launch: the step's inputs as host arrays, nothing queued on the
        device yet. The engine prepares the next step while a grammar's masks still fill for
        the step before it (LLMEngine._launch)."""
        seqs = batch.seqs
        sampled_seqs = [s for s, x in zip(seqs, batch.sampling) if x]
        rows = self.sampler.rows(sampled_seqs, batch.speculating)
        starts = [s.num_computed_tokens for s in seqs]
        tables = self._tables.build(seqs)
        host = host_arrays(batch.num_scheduled_tokens, starts, tables, self.block_size)
        shards = self.tp.size > 1 and rows.shardable
        step = build_step_inputs(batch, host, settings_array(sampled_seqs) if shards else None)
        if self._verifies_in_graph(batch, step):
            step = as_decode_rows(step)
        return PreparedStep(batch, sampled_seqs, rows, step)

    @torch.inference_mode()
    def submit(
        self, prepared: PreparedStep, eos_token_ids: set[int], prev: StepHandle | None = None
    ) -> StepHandle:
        """The device half of a launch: queue the prepared step's forward pass and sampling.

        Sequences whose newest token is still pending take it from `prev`'s sampled tokens on
        the device (asynchronous scheduling; prev's sampler is queued already); a step with
        grammar masks queues its sampler later (StepHandle.sampled).
        """
        batch, sampled_seqs, rows, step = prepared
        if self.workers is not None:
            self.workers.publish(step)  # tensor parallel: every rank runs the same step
        drafts = batch.sampled_drafts() if batch.draft_token_ids else None
        in_graph = self._graph_sampling(step, sampled_seqs, rows, drafts)
        logits, prompt = self.execute(step, prev, in_graph, masked=rows.constrained)
        if self.workers is not None:
            self.workers.step_done()
        pending = None if prev is None else prev.tokens
        handle = self.sampler.sample(logits, sampled_seqs, rows, pending, eos_token_ids, drafts)
        handle.prompt = prompt
        return handle

    @torch.inference_mode()
    def execute(
        self, step: StepInputs, prev: StepHandle | None,
        sampling: Callable[[], SamplingTensors] | None = None, masked: bool = False,
    ) -> tuple[torch.Tensor | DeviceSamples | GraphSampler | None,
               PromptScores | None]:  # fmt: skip
        """Block ops and the forward pass of one step, then its prompt rows scored (every rank
        takes part). On rank 0: its logits rows to sample ([rows, vocab] in the model's dtype:
        the sampler reads them as they are, and bf16/fp16 -> fp32 is exact), or the rows'
        samples when step.samples_sharded or with sampling (from _graph_sampling: sampled
        inside the decode graph; masked: the graph's sampler, to replay once the grammar
        masks are known), None when nothing samples; and the prompt rows' results (None
        without any). Other ranks get (None, None)."""
        # Swaps and copy-on-write copies go before the forward (and outside any CUDA graph).
        run_block_ops(self.kv_cache, self.cpu_kv_cache, step.blocks_to_swap_out,
                      step.blocks_to_swap_in, step.blocks_to_copy)  # fmt: skip
        pending = pending_ids(step, None if prev is None else prev.tokens, self.tp, self.device)
        if self._graph_decode(step):
            out = self.graphs.run(step.input_ids, step.positions, step.slots, step.tables,
                                  step.context_lens, pending=pending, sampling=sampling,
                                  masked=masked)  # fmt: skip
            if not isinstance(out, torch.Tensor):
                return out, None  # sampled in the graph; no prompt row (see _graph_sampling)
            hidden = out
        else:
            hidden = self._forward_eager(step, pending)
        prompt = score_prompt_rows(self.model.compute_logits, hidden, step.prompt_rows,
                                   step.prompt_targets, step.prompt_topk,
                                   self.model_config.vocab_size)  # fmt: skip
        if not len(step.logits_indices):
            return None, prompt
        if not is_arange(step.logits_indices, len(hidden)):  # else every row samples, in order
            hidden = hidden.index_select(0, to_device(step.logits_indices, self.device))
        if step.samples_sharded:
            local, vocab_start = self.model.compute_local_logits(hidden)
            return sample_shards(local, vocab_start, step.sample_settings, self.tp), prompt
        return self.model.compute_logits(hidden), prompt

    def _forward_eager(
        self, step: StepInputs, pending: tuple[torch.Tensor | None, torch.Tensor] | None
    ) -> torch.Tensor:
        """The step's forward pass outside any graph: hidden [num_tokens, hidden_size]."""
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
            ids = to_device(step.input_ids, self.device)
            if pending is not None:
                ids.index_copy_(0, *pending)
        hidden = self.model(ids, positions, meta)
        self.first_kv_pass = None
        if meta.first_kv_pass == "check":
            warn_past_kv_range(self.kv_peaks, self.kv_cache_dtype)
        return hidden
