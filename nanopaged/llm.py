"""The user-facing API (vLLM's LLM): generate, chat and beam_search over one LLMEngine."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from nanopaged.config import EngineArgs
from nanopaged.engine.block_manager import KVStats
from nanopaged.engine.llm_engine import LLMEngine, StepRates
from nanopaged.engine.processor import Request
from nanopaged.engine.request_output import RunningRequest, reports_progress
from nanopaged.engine.sequence import SequenceStatus
from nanopaged.inputs import PromptInput
from nanopaged.outputs import BeamSearchOutput, BeamSearchSequence, LazyLogprobs, RequestOutput
from nanopaged.sampling.output import NonFiniteLogitsError
from nanopaged.sampling_params import BeamSearchParams, SamplingParams
from nanopaged.spec import SpecStats


class LLM:
    """An offline engine over one model: `LLM(path).generate(prompts, SamplingParams(...))`.

    `model` is a Hugging Face model directory (config.json + *.safetensors), a .gguf file, or
    None for the embedded SmolLM2-135M-Instruct; the keyword arguments are EngineArgs' fields
    (see README). Calls from several threads run one at a time, each as it would alone.
    """

    def __init__(self, model: str | os.PathLike | None = None, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineArgs(model=model, **kwargs))
        # One call at a time: the engine, the tokenizer and the seed stream are shared.
        self._lock = threading.Lock()
        self._lock_owner: int | None = None
        self._profiler: torch.profiler.profile | None = None

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLM:
        """The LLM engine_args describe (vLLM's name)."""
        return cls(**vars(engine_args))

    # The engine's parts, under the names users and tests reach them by.
    engine = property(lambda self: self.llm_engine)
    runner = property(lambda self: self.llm_engine.runner)
    scheduler = property(lambda self: self.llm_engine.scheduler)
    block_manager = property(lambda self: self.llm_engine.block_manager)
    tokenizer = property(lambda self: self.llm_engine.tokenizer)
    model_config = property(lambda self: self.llm_engine.model_config)
    model_dir = property(lambda self: self.llm_engine.model_dir)
    config = property(lambda self: self.llm_engine.config)
    device = property(lambda self: self.llm_engine.device)
    dtype = property(lambda self: self.llm_engine.dtype)
    kv_cache_dtype = property(lambda self: self.llm_engine.kv_cache_dtype)
    max_model_len = property(lambda self: self.llm_engine.max_model_len)
    eos_token_ids = property(lambda self: self.llm_engine.eos_token_ids)

    def get_tokenizer(self):
        """The Hugging Face tokenizer in use (None for a model without one)."""
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults (generation_config=
        "auto"): temperature, top_p, top_k, min_p and repetition_penalty where it sets them."""
        return self.llm_engine.processor.default_params()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any; the LLM cannot generate afterwards."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold the LLM for one call; other threads' calls wait for it to end."""
        me = threading.get_ident()
        if self._lock_owner == me:
            raise RuntimeError(
                "this LLM is already running a call in this thread (a generate_iter loop not "
                "yet finished?): finish or close that iterator first"
            )
        with self._lock:
            self._lock_owner = me
            try:
                yield
            finally:
                self._lock_owner = None

    # ---- generation ----------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptInput | list[PromptInput],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt; outputs come back in input order.

        A prompt is a str, a list of token ids, {"prompt": str} or {"prompt_token_ids": [...]}.
        sampling_params=None: get_default_sampling_params().
        """
        with self._exclusive():
            requests = self.llm_engine.processor.requests(prompts, sampling_params)
            return self._collect(requests, use_tqdm)

    def generate_iter(
        self,
        prompts: PromptInput | list[PromptInput],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        partial: bool = False,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """generate(), but each request's final output as soon as it finishes: yields
        (index of its prompt, RequestOutput) in the order requests finish. partial=True also
        yields a request's progress after each step that gives it tokens (finished=False),
        everything so far or only what is new as its SamplingParams.output_kind says
        (CUMULATIVE or DELTA; FINAL_ONLY: the final output only).

        Every prompt and SamplingParams is checked before this returns. Leaving the loop early
        (break, an exception, Ctrl-C) aborts the requests left and frees their blocks; the LLM
        runs no other call until the iterator is exhausted or closed.
        """
        with self._exclusive():
            requests = self.llm_engine.processor.requests(prompts, sampling_params)
        return self._iterate(requests, use_tqdm, partial)

    def _iterate(
        self, requests: list[Request], use_tqdm: bool, partial: bool
    ) -> Iterator[tuple[int, RequestOutput]]:
        with self._exclusive():
            yield from self._outputs(requests, use_tqdm, partial)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation or a list of them.

        A message's content is a str or a list of {"type": "text", "text": str} parts.
        chat_template: a Jinja template to use instead of the tokenizer's.
        continue_final_message: render the last (assistant) message open, to be continued.
        chat_template_kwargs: extra variables for the template.
        """
        with self._exclusive():
            requests = self.llm_engine.processor.chat_requests(
                messages, sampling_params, chat_template, add_generation_prompt,
                continue_final_message, chat_template_kwargs,
            )  # fmt: skip
            return self._collect(requests, use_tqdm)

    def _collect(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        outputs: list[RequestOutput | None] = [None] * len(requests)
        for i, out in self._outputs(requests, use_tqdm, partial=False):
            outputs[i] = out
        return outputs

    def _outputs(
        self, requests: list[Request], use_tqdm: bool, partial: bool
    ) -> Iterator[tuple[int, RequestOutput]]:
        """Run checked requests; yields (index, output) as each finishes (and with partial,
        as each moves)."""
        engine = self.llm_engine
        build = engine.output_builder.build
        for i, running in self._run(requests, use_tqdm, partial):
            yield i, build(running, streaming=partial)

    def _run(
        self,
        requests: list[Request],
        use_tqdm: bool,
        partial: bool = False,
        beam_params: BeamSearchParams | None = None,
    ) -> Iterator[tuple[int, RunningRequest]]:
        """Add requests to the engine and step it until they finish; yields (index, running
        request) as each finishes (with partial, also each that got tokens and reports them).
        Leaving early aborts the requests left and frees their blocks."""
        engine = self.llm_engine
        engine.block_manager.reset_peaks()
        engine.rates = StepRates()
        running = [engine.add(engine.new_request_id(), r, beam_params) for r in requests]
        index = {r.request_id: i for i, r in enumerate(running)}
        num_left = len(running)
        bar = tqdm(total=len(running), desc="Processed prompts", disable=not use_tqdm)
        try:
            while num_left:
                try:
                    grown, finished = engine.run_step()
                except NonFiniteLogitsError as e:  # name the requests as the caller does
                    names = [f"prompts[{index[r]}]" for r in e.request_ids if r in index]
                    raise NonFiniteLogitsError(e.request_ids, names or None) from None
                finished = [r for r in finished if r.request_id in index]
                num_left -= len(finished)
                if use_tqdm:
                    bar.set_postfix_str(engine.rates.describe(), refresh=False)
                    bar.update(len(finished))
                if partial:
                    for r in grown:
                        if r.request_id in index and reports_progress(r.params):
                            yield index[r.request_id], r
                for r in finished:
                    yield index[r.request_id], r
        finally:
            bar.close()
            # Left early (break, an error, Ctrl-C): nothing of this call stays queued or held.
            engine.abort_request([r.request_id for r in running])

    def beam_search(
        self,
        prompts: PromptInput | list[PromptInput],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt; each output holds its best beam_width sequences,
        best first (see BeamSearchParams), their tokens and text starting with the prompt's.
        Beams share KV blocks: a candidate forks its parent's blocks and a beam that falls out
        frees its own."""
        with self._exclusive():
            if not isinstance(params, BeamSearchParams):
                raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
            params.__post_init__()
            # Bookkeeping only: beams take their candidates from the raw logprobs.
            sp = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=True)
            requests = self.llm_engine.processor.beam_requests(prompts, params, sp)
            groups = [None] * len(requests)
            for i, running in self._run(requests, use_tqdm, beam_params=params):
                groups[i] = running.group
            builder = self.llm_engine.output_builder
            decoder = builder.token_decoder()
            return [
                BeamSearchOutput(
                    sequences=[
                        BeamSearchSequence(
                            tokens=r.token_ids + h.token_ids,
                            logprobs=LazyLogprobs.from_rows(h.logprobs, decoder),
                            cum_logprob=h.cumulative_logprob,
                            text=builder.decode(r.token_ids + h.token_ids, True),
                            finish_reason=h.finish_reason,
                        )
                        for h in group.completed_beams
                    ]
                )
                for group, r in zip(groups, requests)
            ]

    # ---- state and profiling -------------------------------------------------------------
    def kv_stats(self) -> KVStats:
        """The KV pool now: blocks total/used/shared/cached-free, slot utilization of the used
        blocks, and the peak used/shared blocks of the last generate or beam_search."""
        running = [
            s for g in self.scheduler.running for s in g.seqs_with_status(SequenceStatus.RUNNING)
        ]
        return self.block_manager.kv_stats(running)

    def spec_stats(self) -> SpecStats:
        """Speculative decoding since this LLM started: drafts proposed and accepted, the
        acceptance rate and the mean accepted length (tokens per verified row); a copy, which
        `later.since(earlier)` turns into the counts of the calls between."""
        return self.llm_engine.spec_stats().copy()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget the prefix cache (see LLMEngine.reset_prefix_cache)."""
        with self._exclusive():
            return self.llm_engine.reset_prefix_cache(reset_running_requests)

    def start_profile(self, profile_dir: str | os.PathLike | None = None) -> None:
        """Start torch's profiler (CPU and, on CUDA, GPU activity) over the calls that follow,
        until stop_profile() writes its Chrome trace to profile_dir (default: the
        NANOPAGED_TORCH_PROFILER_DIR or VLLM_TORCH_PROFILER_DIR environment variable)."""
        if self._profiler is not None:
            raise RuntimeError("the profiler is already running: call stop_profile() first")
        profile_dir = (
            profile_dir
            or os.environ.get("NANOPAGED_TORCH_PROFILER_DIR")
            or os.environ.get("VLLM_TORCH_PROFILER_DIR")
        )
        if not profile_dir:
            raise ValueError(
                "start_profile needs a directory for the trace: pass profile_dir=, or set "
                "NANOPAGED_TORCH_PROFILER_DIR (or VLLM_TORCH_PROFILER_DIR)"
            )
        activities = self.llm_engine.platform.profiler_activities()
        self._profile_dir = Path(profile_dir)
        self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profiler.start()

    def stop_profile(self) -> Path:
        """Stop the profiler start_profile() started; returns the Chrome trace file it wrote
        (open it in Perfetto or chrome://tracing)."""
        if self._profiler is None:
            raise RuntimeError("the profiler is not running: call start_profile() first")
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        self._profile_dir.mkdir(parents=True, exist_ok=True)
        trace = self._profile_dir / f"nanopaged_trace_{os.getpid()}_{id(profiler):x}.json"
        profiler.export_chrome_trace(str(trace))
        return trace
