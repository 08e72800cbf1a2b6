"""The engine (vLLM's LLMEngine): requests in, one step at a time, RequestOutputs out.

add_request checks a request and queues it; step() schedules, launches the forward pass and
sampling, plans and launches the next step while the device runs (when nothing structural
needs this one's samples first), commits the samples, checks stop strings, and reports the
requests that moved; abort_request drops requests and frees their blocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
import weakref
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path

import torch
import xxhash

from nanopaged.config import EngineArgs, ModelConfig, parse_dtype, resolve_kv_cache_dtype
from nanopaged.distributed.parallel import check_tp_shapes
from nanopaged.distributed.workers import TPWorkers, check_device_count
from nanopaged.engine.block_manager import BlockManager
from nanopaged.engine.model_runner import ModelRunner, kv_bytes_per_block
from nanopaged.engine.output_processor import StopMatcher
from nanopaged.engine.processor import InputProcessor, Request
from nanopaged.engine.request_output import OutputBuilder, RunningRequest, reports_progress
from nanopaged.engine.scheduler import ScheduledBatch, Scheduler
from nanopaged.engine.sequence import Sequence, SequenceGroup
from nanopaged.engine.startup import (
    check_engine_args,
    check_vllm_args,
    load_tokenizer,
    resolve_model_dir,
)
from nanopaged.generation_config import load_sampling_defaults, resolve_generation_config
from nanopaged.inputs import PromptInput
from nanopaged.logits_processors import bad_words_token_ids
from nanopaged.outputs import RequestOutput
from nanopaged.platform import platform_of, resolve_device
from nanopaged.sampling.output import NonFiniteLogitsError, StepHandle
from nanopaged.sampling_params import BeamSearchParams, SamplingParams
from nanopaged.spec import SpecStats, proposer_of
from nanopaged.spec.draft import DraftProposer
from nanopaged.spec.stops import find_stops_token_by_token

# Steps between collections of the garbage collector's young generations.
GC_YOUNG_EVERY = 64


class StepRates:
    """Prefill and decode throughput, each over the time of the steps that did that kind of
    work (a step's time: from the previous step's samples to its own)."""

    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.tokens = {"prefill": 0, "decode": 0}
        self.seconds = {"prefill": 0.0, "decode": 0.0}

    def add(self, num_prefill: int, num_decode: int) -> None:
        now = time.perf_counter()
        dt, self.last = now - self.last, now
        for kind, n in (("prefill", num_prefill), ("decode", num_decode)):
            if n:
                self.tokens[kind] += n
                self.seconds[kind] += dt

    def describe(self) -> str:
        return ", ".join(
            f"{kind} {self.tokens[kind] / max(self.seconds[kind], 1e-9):.0f} tok/s"
            for kind in ("prefill", "decode")
        )


def _checked_tokenizer(tokenizer: object, model_dir: Path, tokenizer_mode: str):
    """The tokenizer at `tokenizer` (a path), else the model directory's (None: it has none)."""
    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        raise TypeError(
            f"tokenizer must be a path (str or os.PathLike) or None, "
            f"got {type(tokenizer).__name__}"
        )
    return load_tokenizer(
        Path(tokenizer) if tokenizer else model_dir, use_fast=tokenizer_mode == "auto"
    )


class LLMEngine:
    """One model, its KV cache, scheduler and tokenizer; runs the requests added to it.

    Not for several threads at once (LLM serializes its calls); under tensor parallelism the
    worker processes end with the engine (shutdown(), deletion or interpreter exit).
    """

    def __init__(self, engine_args: EngineArgs) -> None:
        a = engine_args
        check_engine_args(a.model, a.trust_remote_code, a.quantization)
        check_vllm_args(a.enable_chunked_prefill, a.tokenizer_mode, a.task, a.disable_log_stats)
        self.workers: TPWorkers | None = None
        self.config = a.create_engine_config()
        sampling_defaults = self._resolve_model(a)
        self.tokenizer = _checked_tokenizer(a.tokenizer, self.model_dir, a.tokenizer_mode)
        self.eos_token_ids = self._eos_token_ids()
        num_cpu_blocks = self._num_swap_blocks()
        draft = self._start_draft(a)
        self.runner = self._start_runner(a, num_cpu_blocks)
        self.block_manager = BlockManager(
            self.runner.num_blocks, a.block_size, self.config.enable_prefix_caching,
            num_cpu_blocks,
        )  # fmt: skip
        self.scheduler = Scheduler(
            self.block_manager,
            a.max_num_seqs,
            a.max_num_batched_tokens,
            self.max_model_len,
            self.eos_token_ids,
            self.config.preemption_mode,
            *proposer_of(self.config.speculative_config, draft),
        )
        self.processor = InputProcessor(
            self.tokenizer, self.model_dir, self.model_config, self.config, self.max_model_len,
            self.eos_token_ids, self.block_manager, sampling_defaults,
            self.platform.gpu,
        )  # fmt: skip
        self.output_builder = OutputBuilder(self.tokenizer)
        self.stop_matcher = StopMatcher(self.tokenizer)
        self.requests: dict[str, RunningRequest] = {}
        self.rates = StepRates()
        # A launched step planned before its predecessor's samples were known.
        self._in_flight: tuple[ScheduledBatch, StepHandle] | None = None
        # Structured-outputs requests whose grammar is compiling: (group, its Future).
        self._compiling: list[tuple[SequenceGroup, Future]] = []
        # Sequences whose matchers are moving past their newest tokens (_advance_matchers),
        # and those whose grammar ended there (_matched), reported with the step's outputs.
        self._matching: list[Sequence] = []
        self._grammar_stopped: list[Sequence] = []
        self._num_steps = 0
        self._num_request_ids = 0
        self._num_drawn_seeds = 0

    def _resolve_model(self, a: EngineArgs) -> dict:
        """The device, the model's directory and config, the longest sequence and the dtypes
        it runs and caches in, each checked before anything loads; returns the model's
        SamplingParams defaults (its generation config)."""
        requested_dtype = parse_dtype(a.dtype)
        self.device = resolve_device(a.device)
        self.platform = platform_of(self.device)
        # A dtype the device cannot hold is an error before anything loads.
        fp8_dtype = resolve_kv_cache_dtype(a.kv_cache_dtype, self.device)
        self.async_scheduling = (
            self.platform.async_scheduling if a.async_scheduling is None else a.async_scheduling
        )
        # A GGUF converts into a cache entry holding the dtype the model will run in: the
        # one asked for, else what "auto" picks below for a float32 checkpoint.
        gguf_dtype = requested_dtype
        if gguf_dtype is None:
            gguf_dtype = self.platform.default_dtype(torch.float32)
        self.model_dir = resolve_model_dir(a.model, gguf_dtype)
        self.model_config = ModelConfig.from_dir(self.model_dir, a.hf_overrides, a.quantization)
        gen_path = resolve_generation_config(a.generation_config, self.model_dir)
        sampling_defaults = load_sampling_defaults(gen_path)
        try:
            SamplingParams(**sampling_defaults)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{gen_path}: {e}") from None
        limit = self.model_config.max_position_embeddings
        if a.max_model_len is not None and a.max_model_len > limit:
            raise ValueError(
                f"max_model_len must be <= the model's max_position_embeddings ({limit}), "
                f"got {a.max_model_len}"
            )
        self.max_model_len = a.max_model_len or limit
        self.dtype = requested_dtype
        if self.dtype is None:
            self.dtype = self.platform.default_dtype(self.model_config.dtype)
        self.kv_cache_dtype = self.dtype if fp8_dtype is None else fp8_dtype
        return sampling_defaults

    def _eos_token_ids(self) -> set[int]:
        """The model's EOS ids and the tokenizer's, which must be a token of the model."""
        eos_token_ids = set(self.model_config.eos_token_ids)
        tok_eos = None if self.tokenizer is None else self.tokenizer.eos_token_id
        if tok_eos is not None:
            vocab = self.model_config.vocab_size
            if not 0 <= tok_eos < vocab:
                raise ValueError(
                    f"the tokenizer's eos_token_id {tok_eos} is outside the model's vocabulary "
                    f"[0, {vocab}): the tokenizer does not belong to this model"
                )
            eos_token_ids.add(tok_eos)
        return eos_token_ids

    def _num_swap_blocks(self) -> int:
        """The CPU swap pool's blocks (preemption_mode="swap"), 0 without one."""
        if self.config.preemption_mode != "swap":
            return 0
        per_block = kv_bytes_per_block(self.model_config, self.config.block_size,
                                       self.kv_cache_dtype)  # fmt: skip
        num_cpu_blocks = int(self.config.swap_space * 2**30) // per_block
        if num_cpu_blocks == 0:
            raise ValueError(
                f"swap_space={self.config.swap_space} GiB holds no KV block ({per_block} bytes "
                "each); raise swap_space"
            )
        return num_cpu_blocks

    def _start_draft(self, a: EngineArgs) -> DraftProposer | None:
        """The draft model of a "draft_model" speculative_config, loaded before the target
        with its share of the KV budget (self.config keeps the target's share)."""
        spec = self.config.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        draft, self.config = DraftProposer.start(
            spec, self.config, self.model_config, self.max_model_len, self.device, self.dtype,
            self.platform.gpu, self.kv_cache_dtype, a.load_format,
        )  # fmt: skip
        return draft

    def _start_runner(self, a: EngineArgs, num_cpu_blocks: int) -> ModelRunner:
        """Rank 0's ModelRunner, with the tensor-parallel workers started first (they end with
        this engine: on shutdown(), deletion or interpreter exit)."""
        runner_kwargs = dict(
            model_dir=self.model_dir,
            model_config=self.model_config,
            engine_config=self.config,
            max_model_len=self.max_model_len,
            dtype=self.dtype,
            load_format=a.load_format,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        if a.tensor_parallel_size > 1:
            c = self.model_config
            moe = {"moe_intermediate_size": c.moe_intermediate_size,
                   "shared_expert_intermediate_size": c.shared_expert_intermediate_size}
            check_tp_shapes(c.num_heads, c.num_kv_heads, c.intermediate_size,
                            a.tensor_parallel_size, moe if c.num_experts else None)  # fmt: skip
            check_device_count(a.tensor_parallel_size, self.device)
            self.device = self.platform.rank_device(0)
            self.workers = TPWorkers(a.tensor_parallel_size, self.device, runner_kwargs)
            self._finalizer = weakref.finalize(self, self.workers.shutdown)
        try:
            runner = ModelRunner(
                **runner_kwargs,
                device=self.device,
                tp=self.workers.tp if self.workers else None,
                workers=self.workers,
            )
            if num_cpu_blocks:
                runner.allocate_swap_space(num_cpu_blocks)
        except BaseException:
            if self.workers is not None:
                self.workers.shutdown(abort=True)  # they may wait in a collective for us
            raise
        return runner

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        """The engine engine_args describe (vLLM's name)."""
        return cls(engine_args)

    def get_tokenizer(self):
        """The Hugging Face tokenizer in use (None for a model without one)."""
        return self.tokenizer

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any; the engine cannot run afterwards."""
        if self.workers is not None:
            self.workers.shutdown(abort=not self.workers.alive)

    # ---- requests ------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: PromptInput, params: SamplingParams | None = None
    ) -> None:
        """Check one request and queue it; a refused request is a ValueError/TypeError and
        nothing is queued. params=None: the model's default SamplingParams."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running; ids must be unique")
        if isinstance(params, BeamSearchParams):
            raise TypeError("params must be a SamplingParams; beam search is LLM.beam_search")
        [request] = self.processor.requests([prompt], None if params is None else [params])
        self.add(request_id, request)

    def add(
        self, request_id: str, request: Request, beam_params: BeamSearchParams | None = None
    ) -> RunningRequest:
        """Queue a checked request under request_id."""
        p = request.params
        group_params = p
        if (p.best_of or p.n) > p.n and p.logprobs is None:
            # best_of ranks the samples by cumulative_logprob, which logprobs=0 sets
            group_params = dataclasses.replace(p, logprobs=0)
        seq = Sequence(request.token_ids, group_params, request_id=request_id)
        if p.seed is not None:
            seq.seed = p.seed
        elif not p.greedy:
            seq.seed = self._draw_seed()
        if p.bad_words:
            seq.bad_words_token_ids = bad_words_token_ids(p.bad_words, self.tokenizer)
        group = SequenceGroup(request_id, seq, beam_params=beam_params)
        running = RunningRequest(request_id, request.prompt, p, group)
        self.requests[request_id] = running
        if p.structured_outputs is None:
            self.scheduler.add(group)
        else:  # scheduled once its grammar compiled, other requests running meanwhile
            self._compiling.append((group, self._grammars().submit(p.structured_outputs)))
        return running

    def _grammars(self):
        """The structured-outputs backend (nanopaged.structured), made at the first request
        that asks; the Sampler fills its rows' masks through it."""
        sampler = self.runner.sampler
        if sampler.structured is None:
            from nanopaged.structured import StructuredBackend

            sampler.structured = StructuredBackend(
                self.tokenizer, self.model_config.vocab_size, self.eos_token_ids
            )
        return sampler.structured

    def _admit_compiled(self) -> None:
        """Schedule the requests whose grammar compiled (waiting for the first when nothing
        else can run), each sequence with a matcher at the grammar's start."""
        if not self._compiling:
            return
        if not self.scheduler.has_unfinished():
            waited = time.perf_counter()
            self._compiling[0][1].result()
            self._grammars().stats.waited_seconds += time.perf_counter() - waited
        waiting = []
        for group, future in self._compiling:
            if not future.done():
                waiting.append((group, future))
                continue
            compiled = future.result()
            for seq in group.seqs:
                seq.matcher = compiled.matcher()
            self.scheduler.add(group)
        self._compiling = waiting

    def _advance_matchers(self, seqs: list[Sequence]) -> None:
        """Start feeding each sequence's new tokens to its grammar's matcher, on the grammar
        backend's thread while the engine goes on; _matched() waits for it."""
        structured = self.runner.sampler.structured
        if structured is None:  # no request ever had a grammar
            return
        rows = []
        for seq in seqs:
            if seq.matcher is None or seq.is_finished:
                continue
            new = seq.token_ids[seq.num_prompt_tokens + seq.num_matched :]
            seq.num_matched += len(new)
            self._matching.append(seq)
            rows.append((seq.matcher, new))
        structured.accept(rows)  # one token each, in parallel on llguidance's threads

    def _matched(self) -> None:
        """Wait for the matchers _advance_matchers() moved on, before anything reads them (the
        next sampler's masks, a fork). A grammar that can take nothing more allows EOS alone:
        a request that ignores EOS finishes there ("stop"), reported with this step's
        outputs; a step launched since drops its token."""
        seqs, self._matching = self._matching, []
        if not seqs:
            return
        self.runner.sampler.structured.wait()
        for seq in seqs:
            if (not seq.is_finished and seq.sampling_params.ignore_eos
                    and seq.matcher.is_terminated()):  # fmt: skip
                self.scheduler.finish(seq, "stop", None)
                self._grammar_stopped.append(seq)

    def new_request_id(self) -> str:
        """A request id no running request has."""
        while str(self._num_request_ids) in self.requests:
            self._num_request_ids += 1
        self._num_request_ids += 1
        return str(self._num_request_ids - 1)

    def _draw_seed(self) -> int:
        """The seed of a sampled request that has none: the next of a stream derived from the
        engine's seed, so the same calls on a new engine reproduce the same samples."""
        self._num_drawn_seeds += 1
        return xxhash.xxh64_intdigest(f"{self.config.seed}/{self._num_drawn_seeds}".encode())

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Drop requests (ids not running are ignored) and free their blocks; a step already
        on the device drops their tokens."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            running = self.requests.pop(rid, None)
            if running is not None:
                self.scheduler.abort(running.group)
                self._compiling = [c for c in self._compiling if c[0] is not running.group]
        if not self.requests:
            self._drain()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def spec_stats(self) -> SpecStats:
        """Speculative decoding's counts since the engine started (all zero without it)."""
        return self.scheduler.spec_stats

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget the prefix cache; False (nothing forgotten) while requests hold blocks,
        unless reset_running_requests (their blocks are then never hit again)."""
        return self.block_manager.reset_prefix_cache(reset_running_requests)

    # ---- steps ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; the outputs of the requests that finished in it and, as their
        SamplingParams.output_kind asks, of those that got tokens."""
        grown, finished = self.run_step()
        build = self.output_builder.build
        return [build(r, streaming=True) for r in grown if reports_progress(r.params)] + [
            build(r, streaming=True) for r in finished
        ]

    def run_step(self) -> tuple[list[RunningRequest], list[RunningRequest]]:
        """One step: (requests that got tokens and still run, requests that finished); the
        finished ones leave the engine. On any error or interruption every request is
        dropped and every block freed, so the engine stays usable."""
        # No full garbage collection inside a step: one walks every object of the process
        # (the model's, the tokenizer's, the logprob rows), 0.3-0.4 s at a time in a
        # logprobs run. The young generations are collected every GC_YOUNG_EVERY steps.
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._num_steps += 1
            if collecting and self._num_steps % GC_YOUNG_EVERY == 0:
                gc.collect(1)
            return self._step()
        except BaseException as e:
            # After NaN logits the running requests' K/V may be NaN: forgotten and zeroed, so
            # no later request reads them.
            poisoned = []
            if isinstance(e, NonFiniteLogitsError):
                poisoned = sorted({b for g in self.scheduler.running for s in g.seqs
                                   for b in s.block_table})  # fmt: skip
            self._abort_all()
            if poisoned:
                self.block_manager.forget(poisoned)
                self.runner.zero_blocks(poisoned)
            raise
        finally:
            if collecting:
                gc.enable()

    def may_run_ahead(self, batch: ScheduledBatch, handle: StepHandle) -> bool:
        """The one decision: may the next step be planned and launched before this one's
        samples reach the host? Only when its samples stay on the device (StepHandle.run_ahead,
        from the step's rows) and no structural event (fork, copy-on-write, preemption, swap,
        beam step) needs them first. Grammar masks hold back only the next step's sampler
        (StepHandle.sampled): its forward pass runs ahead.
        Prompt logprobs the step scores travel with its samples and are recorded at its commit,
        and the next step scores none of their positions: they hold nothing back."""
        return self.async_scheduling and handle.run_ahead and self.scheduler.can_look_ahead(batch)

    def _step(self) -> tuple[list[RunningRequest], list[RunningRequest]]:
        self._admit_compiled()
        launched, self._in_flight = self._in_flight, None
        if launched is None:
            self._matched()  # before scheduling, which may preempt a sequence it finishes
            if not self.scheduler.has_unfinished():
                return [], self._ended([], [])
            launched = self._launch()
            if launched is None:
                raise RuntimeError("the scheduler could not make progress")  # invariant
        batch, handle = launched
        # A decode row computes the last sampled token (and its drafts, speculating): it
        # samples, past the prompt, from one token; prompts are prefill, however short.
        num_decode = sum(
            n
            for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_scheduled_tokens))
            if batch.sampling[i]
            and n - batch.num_drafts(i) == 1
            and seq.num_computed_tokens >= seq.num_prompt_tokens
        )
        ahead = self.may_run_ahead(batch, handle)
        if not ahead:  # a deferred sampler reads its sequences as they are now
            self._matched()
            handle = handle.sampled()
        self.scheduler.advance(batch)
        if ahead:  # plan and launch the next step while this one runs on the device
            self._in_flight = self._launch(prev=handle)  # it samples this one in between
        handle = handle.sampled()
        step = self.scheduler.commit(
            batch, handle.result(), handle.logprobs(), handle.prompt_logprobs()
        )
        self._advance_matchers(step.grown)
        stopped = self._check_stop_strings(step.grown, step.num_new_tokens)
        self.rates.add(batch.total_tokens - num_decode, num_decode)
        finished = self._ended(step.finished_groups, stopped)
        grown_ids = dict.fromkeys(s.group.request_id for s in step.grown)
        grown = [self.requests[rid] for rid in grown_ids if rid in self.requests]
        if not self.requests:
            self._drain()
        return grown, finished

    def _ended(self, groups: list[SequenceGroup], stopped: list[Sequence]) -> list[RunningRequest]:
        """The requests that ended: groups that finished, and those of sequences that stopped
        (here, or at their grammar's end in _matched) where that finished the group. Each once
        (two samples of one request can both stop in a step); they leave the engine."""
        stopped, self._grammar_stopped = self._grammar_stopped + stopped, []
        done = {g.request_id: g for g in groups}
        done.update((s.group.request_id, s.group) for s in stopped if s.group.is_finished)
        return [self.requests.pop(rid) for rid in done if rid in self.requests]

    def _launch(self, prev: StepHandle | None = None) -> tuple[ScheduledBatch, StepHandle] | None:
        """Schedule a step and queue it on the device (None: nothing to run). prev: the step
        launched before it, whose samples are still on the device.

        A step with grammar masks samples (prev.sampled()) once the matchers took the tokens
        of the step before it, at that step's commit; their masks fill on the host meanwhile,
        while this step is planned and its inputs prepared. Its samples are queued before
        this step's forward pass, which reads them on the device."""
        batch = self.scheduler.schedule()
        prepared = self.runner.prepare(batch) if batch.seqs else None
        if prev is not None:
            # Planned ahead, so nothing was preempted (Scheduler.can_look_ahead) while the
            # matchers moved on.
            self._matched()
            prev = prev.sampled()
        if prepared is None:
            return None
        return batch, self.runner.submit(prepared, self.eos_token_ids, prev=prev)

    def _drain(self) -> None:
        """Wait out a step launched ahead whose sequences have all ended: its tokens are
        dropped, and nothing of it may still be copying when the engine goes idle."""
        self._matched()
        if self._in_flight is not None:
            (_, handle), self._in_flight = self._in_flight, None
            handle.sampled().result()

    def _abort_all(self) -> None:
        """After a failed or interrupted step: drop every request and free every block."""
        self._in_flight = None
        self._compiling = []
        self._matching, self._grammar_stopped = [], []
        if self.runner.sampler.structured is not None:
            # Nothing may still move the matchers. An error of theirs goes with the one being
            # raised (the engine's, or theirs re-raised by _matched).
            with contextlib.suppress(Exception):
                self.runner.sampler.structured.wait()
        self.requests.clear()
        self.scheduler.abort_all()
        # No request outlives this, so no block may stay held, even one that a step cut
        # short left outside the scheduler's lists.
        self.block_manager.free_all()
        if self.workers is not None:
            # A step cut short leaves the workers out of step; a worker's error wins.
            self.workers.after_error()

    def _check_stop_strings(
        self, seqs: list[Sequence], num_new_tokens: dict[int, int]
    ) -> list[Sequence]:
        """Finish sequences whose text now holds a stop string; returns those it finished.
        num_new_tokens: seq_id -> tokens appended this step, where more than one (speculative
        decoding): such a sequence keeps only those up to the first that completes a string."""
        # A stop string may only end in text that appears once min_tokens tokens are out:
        # in the text of a token after the first min_tokens (the first that EOS may be).
        watched = [
            s for s in seqs
            if s.sampling_params.stop and s.num_output_tokens > s.sampling_params.min_tokens
        ]  # fmt: skip
        if not watched:
            return []
        finished = []
        hits = []
        if num_new_tokens:  # speculative decoding: rows that took several tokens at once
            runs = [s for s in watched if s.seq_id in num_new_tokens]
            watched = [s for s in watched if s.seq_id not in num_new_tokens]
            hits = find_stops_token_by_token(self.stop_matcher, runs, num_new_tokens)
        for seq, idx, stop, full in hits + self.stop_matcher.find(watched):
            p = seq.sampling_params
            seq.text = full[: idx + len(stop)] if p.include_stop_str_in_output else full[:idx]
            if seq.is_finished:  # ended by length or EOS this very step: the string wins
                seq.finish_reason, seq.stop_reason = "stop", stop
            else:
                self.scheduler.finish(seq, "stop", stop)
                finished.append(seq)
        return finished
