"""The user-facing engine: validate, tokenize, run the request loop, detokenize."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import weakref
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC
from pathlib import Path

import torch
import xxhash

from nanopaged.config import EngineConfig, ModelConfig, parse_dtype, resolve_kv_cache_dtype
from nanopaged.distributed.parallel import check_tp_shapes
from nanopaged.distributed.workers import TPWorkers, check_device_count
from nanopaged.engine.block_manager import BlockManager, KVStats
from nanopaged.engine.group import SequenceGroup
from nanopaged.engine.llm_engine import LLMEngine
from nanopaged.engine.model_runner import ModelRunner, kv_bytes_per_block
from nanopaged.engine.output_processor import decode_batch
from nanopaged.engine.scheduler import Scheduler
from nanopaged.engine.sequence import Sequence, SequenceStatus
from nanopaged.generation_config import load_sampling_defaults, resolve_generation_config
from nanopaged.inputs import PromptInput, PromptType, check_unicode, normalize_prompts
from nanopaged.logits_processors import bad_words_token_ids
from nanopaged.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    LazyLogprobs,
    RequestOutput,
    TokenDecoder,
)
from nanopaged.sampling_params import BeamSearchParams, SamplingParams

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")



def _resolve_model_dir(
    model: str | os.PathLike | None, gguf_dtype: torch.dtype | None = None
) -> Path:
    from nanopaged.gguf import resolve_model

    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise TypeError(
            f"model must be a path (str or os.PathLike) or None, got {type(model).__name__}"
        )
    return resolve_model(model, gguf_dtype)


def _check_engine_args(
    model: object, trust_remote_code: object, quantization: object
) -> None:
    """vLLM engine arguments nanopaged takes only in the values it supports."""
    if trust_remote_code is not False:
        raise ValueError(
            f"trust_remote_code must be False, got {trust_remote_code!r}: nanopaged runs only its "
            "own model code and never imports code shipped beside a model"
        )
    is_gguf = isinstance(model, (str, os.PathLike)) and str(model).endswith(".gguf")
    if quantization is not None and not (
        isinstance(quantization, str) and quantization.lower() == "gguf" and is_gguf
    ):
        raise ValueError(
            f"quantization={quantization!r} is not supported: use None (the checkpoint's "
            "dtype) or a .gguf model file (quantization='gguf' or None)"
        )


def _check_vllm_args(
    enable_chunked_prefill: object, tokenizer_mode: object, task: object, disable_log_stats: object
) -> None:
    """vLLM arguments that name what nanopaged always does (or ask for what it does not)."""
    if enable_chunked_prefill not in (None, True):
        raise ValueError(
            f"enable_chunked_prefill must be True or None, got {enable_chunked_prefill!r}: "
            "nanopaged always splits long prompts into chunks of max_num_batched_tokens"
        )
    if tokenizer_mode not in ("auto", "slow"):
        raise ValueError(
            f"tokenizer_mode must be 'auto' (the fast tokenizer where one exists) or 'slow', "
            f"got {tokenizer_mode!r}"
        )
    if task not in ("auto", "generate"):
        raise ValueError(
            f"task must be 'auto' or 'generate', got {task!r}: nanopaged runs generative "
            "models only"
        )
    if not isinstance(disable_log_stats, bool):
        raise TypeError(
            f"disable_log_stats must be a bool, got {type(disable_log_stats).__name__} "
            "(nanopaged logs no periodic stats either way)"
        )


def _resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA device is available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(
            f"device {device!r} does not exist: this machine has "
            f"{torch.cuda.device_count()} CUDA device(s)"
        )
    return dev


def _text_parts_joined(conv: object) -> object:
    """A conversation whose list-of-text-parts contents (OpenAI's form) are joined into str;
    anything else is left for the caller's checks."""
    if not isinstance(conv, SequenceABC) or isinstance(conv, str):
        return conv
    out = []
    for m in conv:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and all(
            isinstance(part, dict) and part.get("type") == "text" and isinstance(
                part.get("text"), str
            )
            for part in content
        ):
            m = {**m, "content": "".join(part["text"] for part in content)}
        out.append(m)
    return out


class LLM:
    """An offline engine over one model: `LLM(path).generate(prompts, SamplingParams(...))`.

    `model` is a Hugging Face model directory (config.json + *.safetensors), a .gguf file, or
    None for the embedded SmolLM2-135M-Instruct. Calls from several threads run one at a
    time, each as it would alone.
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        tokenizer: str | os.PathLike | None = None,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 16384,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        kv_cache_memory: int | None = None,
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        seed: int = 0,
        preemption_mode: str = "recompute",
        swap_space: float = 4.0,
        async_scheduling: bool | None = None,
        tensor_parallel_size: int = 1,
        trust_remote_code: bool = False,
        quantization: str | None = None,
        generation_config: str | os.PathLike = "auto",
        load_format: str = "auto",
        kv_cache_dtype: str = "auto",
        calculate_kv_scales: bool = False,
        max_logprobs: int = 20,
        enable_chunked_prefill: bool | None = None,
        tokenizer_mode: str = "auto",
        task: str = "auto",
        disable_log_stats: bool = True,
    ) -> None:
        _check_engine_args(model, trust_remote_code, quantization)
        _check_vllm_args(enable_chunked_prefill, tokenizer_mode, task, disable_log_stats)
        self._workers: TPWorkers | None = None
        self.config = EngineConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            kv_cache_memory=kv_cache_memory,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            seed=seed,
            max_model_len=max_model_len,
            preemption_mode=preemption_mode,
            swap_space=swap_space,
            async_scheduling=async_scheduling,
            tensor_parallel_size=tensor_parallel_size,
            load_format=load_format,
            kv_cache_dtype=kv_cache_dtype,
            calculate_kv_scales=calculate_kv_scales,
            max_logprobs=max_logprobs,
        )
        requested_dtype = parse_dtype(dtype)
        self.device = _resolve_device(device)
        # A dtype the device cannot hold is an error before anything loads.
        fp8_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.device)
        self.async_scheduling = (
            self.device.type == "cuda" if async_scheduling is None else async_scheduling
        )
        # A GGUF converts into a cache entry holding the dtype the model will run in: the
        # one asked for, else float32 on CPU (exact) and bfloat16 on CUDA, as "auto" picks
        # for a float32 checkpoint below.
        gguf_dtype = requested_dtype
        if gguf_dtype is None:
            gguf_dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.model_dir = _resolve_model_dir(model, gguf_dtype)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        gen_path = resolve_generation_config(generation_config, self.model_dir)
        self._sampling_defaults = load_sampling_defaults(gen_path)
        try:
            SamplingParams(**self._sampling_defaults)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{gen_path}: {e}") from None
        limit = self.model_config.max_position_embeddings
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(
                f"max_model_len must be <= the model's max_position_embeddings ({limit}), "
                f"got {max_model_len}"
            )
        self.max_model_len = max_model_len or limit
        if requested_dtype is not None:
            self.dtype = requested_dtype
        elif self.device.type == "cpu":
            self.dtype = torch.float32  # CPUs rarely have fast half-precision matmuls
        else:
            cfg_dtype = self.model_config.dtype
            self.dtype = torch.bfloat16 if cfg_dtype == torch.float32 else cfg_dtype
        self.kv_cache_dtype = self.dtype if fp8_dtype is None else fp8_dtype
        if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
            raise TypeError(
                f"tokenizer must be a path (str or os.PathLike) or None, "
                f"got {type(tokenizer).__name__}"
            )
        self.tokenizer = self._load_tokenizer(
            Path(tokenizer) if tokenizer else self.model_dir, use_fast=tokenizer_mode == "auto"
        )
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        tok_eos = None if self.tokenizer is None else self.tokenizer.eos_token_id
        if tok_eos is not None:
            vocab = self.model_config.vocab_size
            if not 0 <= tok_eos < vocab:
                raise ValueError(
                    f"the tokenizer's eos_token_id {tok_eos} is outside the model's vocabulary "
                    f"[0, {vocab}): the tokenizer does not belong to this model"
                )
            self.eos_token_ids.add(tok_eos)
        num_cpu_blocks = 0
        if self.config.preemption_mode == "swap":
            per_block = kv_bytes_per_block(self.model_config, block_size, self.kv_cache_dtype)
            num_cpu_blocks = int(self.config.swap_space * 2**30) // per_block
            if num_cpu_blocks == 0:
                raise ValueError(
                    f"swap_space={swap_space} GiB holds no KV block ({per_block} bytes each); "
                    "raise swap_space"
                )
        runner_kwargs = dict(
            model_dir=self.model_dir,
            model_config=self.model_config,
            engine_config=self.config,
            max_model_len=self.max_model_len,
            dtype=self.dtype,
            load_format=load_format,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        if tensor_parallel_size > 1:
            c = self.model_config
            moe = {"moe_intermediate_size": c.moe_intermediate_size,
                   "shared_expert_intermediate_size": c.shared_expert_intermediate_size}
            check_tp_shapes(c.num_heads, c.num_kv_heads, c.intermediate_size,
                            tensor_parallel_size, moe if c.num_experts else None)  # fmt: skip
            check_device_count(tensor_parallel_size, self.device)
            if self.device.type == "cuda":
                self.device = torch.device("cuda", 0)  # rank r runs on cuda:r
            self._workers = TPWorkers(tensor_parallel_size, self.device, runner_kwargs)
            # Workers end with this LLM: on shutdown(), deletion or interpreter exit.
            self._finalizer = weakref.finalize(self, self._workers.shutdown)
        try:
            self.runner = ModelRunner(
                **runner_kwargs,
                device=self.device,
                tp=self._workers.tp if self._workers else None,
                workers=self._workers,
            )
            if num_cpu_blocks:
                self.runner.allocate_swap_space(num_cpu_blocks)
        except BaseException:
            if self._workers is not None:
                self._workers.shutdown(abort=True)  # they may wait in a collective for us
            raise
        self.block_manager = BlockManager(
            self.runner.num_blocks, block_size, self.config.enable_prefix_caching, num_cpu_blocks
        )
        eos = self.eos_token_ids
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs,
            max_num_batched_tokens,
            self.max_model_len,
            eos,
            self.config.preemption_mode,
        )
        self.engine = LLMEngine(
            self.scheduler,
            self.block_manager,
            self.runner,
            eos,
            self.tokenizer,
            self.async_scheduling,
            self._workers,
        )
        self._request_counter = 0
        self._num_drawn_seeds = 0
        self._decoded_tokens: dict[int, str] = {}
        # One call at a time: the engine, the tokenizer and the seed stream are shared.
        self._lock = threading.Lock()
        self._lock_owner: int | None = None
        self._profiler: torch.profiler.profile | None = None

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
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
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
        trace = self._profile_dir / f"nanopaged_trace_{os.getpid()}_{self._request_counter}.json"
        profiler.export_chrome_trace(str(trace))
        return trace

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any; the LLM cannot generate afterwards."""
        if self._workers is not None:
            self._workers.shutdown(abort=not self._workers.alive)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @staticmethod
    def _load_tokenizer(path: Path, use_fast: bool = True):
        if not path.exists():
            raise FileNotFoundError(f"tokenizer path {str(path)!r} does not exist")
        if path.is_dir() and not any((path / f).exists() for f in _TOKENIZER_FILES):
            return None
        from transformers import AutoTokenizer

        try:
            # Local files only, and never code shipped beside the model (auto_map).
            return AutoTokenizer.from_pretrained(
                str(path), trust_remote_code=False, local_files_only=True, use_fast=use_fast
            )
        except Exception as e:  # transformers raises its own and huggingface_hub's kinds
            raise ValueError(
                f"cannot load the tokenizer in {path} (nanopaged never runs code from a model "
                f"directory): {type(e).__name__}: {e}"
            ) from e

    # ---- input validation ----------------------------------------------------------------
    def _normalize_prompts(self, prompts) -> list[PromptType]:
        return normalize_prompts(prompts)

    def get_tokenizer(self):
        """The Hugging Face tokenizer in use (None for a model without one)."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults (generation_config=
        "auto"): temperature, top_p, top_k, min_p and repetition_penalty where it sets them."""
        return SamplingParams(**self._sampling_defaults)

    def _tokenize(
        self, prompt: PromptType, index: int, truncate_prompt_tokens: int | None = None
    ) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"prompts[{index}] is text but no tokenizer was found in {self.model_dir}; "
                    "pass token ids, or tokenizer=PATH"
                )
            check_unicode(prompt, f"prompts[{index}]")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = prompt
        if truncate_prompt_tokens is not None:
            keep = self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
            token_ids = token_ids[-keep:]
        if not token_ids:
            raise ValueError(f"prompts[{index}] is empty: a prompt needs at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(
                f"prompts[{index}] holds token id {bad}, outside the vocabulary [0, {vocab})"
            )
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"prompts[{index}] has {len(token_ids)} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        return token_ids

    def _normalize_params(self, sampling_params, num_prompts: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            self._check_params(sampling_params, "sampling_params")
            return [sampling_params] * num_prompts
        if isinstance(sampling_params, SequenceABC):
            params = list(sampling_params)
            if len(params) != num_prompts:
                raise ValueError(
                    f"sampling_params has {len(params)} entries but there are {num_prompts} "
                    "prompts; pass one SamplingParams or one per prompt"
                )
            for i, p in enumerate(params):
                if not isinstance(p, SamplingParams):
                    raise TypeError(
                        f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}"
                    )
                self._check_params(p, f"sampling_params[{i}]")
            return params
        raise TypeError(
            "sampling_params must be a SamplingParams or a list of them, "
            f"got {type(sampling_params).__name__}"
        )

    def _check_params(self, p: SamplingParams, name: str) -> None:
        """Check p again, now against this model: its fields may have changed since it was made."""
        try:
            p.__post_init__()
        except (ValueError, TypeError) as e:
            raise type(e)(f"{name}: {e}") from None
        if p.min_tokens and p.allowed_token_ids is not None:
            early_stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
            if early_stops.issuperset(p.allowed_token_ids):
                raise ValueError(
                    f"{name}.allowed_token_ids holds only stop tokens (EOS or stop_token_ids), "
                    f"which min_tokens={p.min_tokens} forbids: no token could be sampled; allow "
                    "other tokens, or set min_tokens=0"
                )
        cap = self.config.max_logprobs
        for field_name in ("logprobs", "prompt_logprobs"):
            value = getattr(p, field_name)
            if cap != -1 and value is not None and value > cap:
                raise ValueError(
                    f"{name}.{field_name}={value} is more than max_logprobs={cap}; ask for at "
                    "most max_logprobs, or raise LLM(max_logprobs=...) (-1: no cap)"
                )
        vocab = self.model_config.vocab_size
        bad = next((t for t in p.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise ValueError(
                f"{name}.stop_token_ids holds {bad}, outside the vocabulary [0, {vocab})"
            )
        for field_name in ("logit_bias", "allowed_token_ids"):
            ids = getattr(p, field_name) or ()
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise ValueError(
                    f"{name}.{field_name} holds {bad}, outside the vocabulary [0, {vocab})"
                )
        if p.bad_words and self.tokenizer is None:
            raise ValueError(
                f"{name}.bad_words needs a tokenizer, but {self.model_dir} has none; pass "
                "tokenizer=PATH or use logit_bias"
            )
        if p.stop and self.tokenizer is None:
            raise ValueError(
                f"{name}.stop needs a tokenizer to find stop strings, but {self.model_dir} has "
                "none; pass tokenizer=PATH or use stop_token_ids"
            )

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
            return self._generate(*self._requests(prompts, sampling_params), use_tqdm)

    def generate_iter(
        self,
        prompts: PromptInput | list[PromptInput],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """generate(), but each request's final output as soon as it finishes: yields
        (index of its prompt, RequestOutput) in the order requests finish.

        Every prompt and SamplingParams is checked before this returns. Leaving the loop early
        (break, an exception, Ctrl-C) aborts the requests left and frees their blocks; the LLM
        runs no other call until the iterator is exhausted or closed.
        """
        with self._exclusive():
            requests = self._requests(prompts, sampling_params)
        return self._iterate(*requests, use_tqdm)

    def _iterate(
        self,
        prompt_list: list[PromptType],
        token_lists: list[list[int]],
        params: list[SamplingParams],
        use_tqdm: bool,
    ) -> Iterator[tuple[int, RequestOutput]]:
        with self._exclusive():
            yield from self._run(prompt_list, token_lists, params, use_tqdm)

    def _requests(
        self, prompts, sampling_params
    ) -> tuple[list[PromptType], list[list[int]], list[SamplingParams]]:
        """The checked prompts, their token ids and their SamplingParams."""
        prompt_list = self._normalize_prompts(prompts)
        params = self._normalize_params(sampling_params, len(prompt_list))
        token_lists = [
            self._tokenize(p, i, sp.truncate_prompt_tokens)
            for i, (p, sp) in enumerate(zip(prompt_list, params))
        ]
        return prompt_list, token_lists, self._fitted(token_lists, params)

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
            return self._chat(
                messages, sampling_params, use_tqdm, chat_template, add_generation_prompt,
                continue_final_message, chat_template_kwargs,
            )  # fmt: skip

    def _chat(
        self,
        messages,
        sampling_params,
        use_tqdm: bool,
        chat_template: str | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: dict | None,
    ) -> list[RequestOutput]:
        if not isinstance(messages, SequenceABC) or isinstance(messages, str) or not messages:
            raise TypeError(
                "messages must be a non-empty list of {'role', 'content'} dicts, or a list of "
                "such lists"
            )
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        conversations = [_text_parts_joined(conv) for conv in conversations]
        for i, conv in enumerate(conversations):
            if not isinstance(conv, SequenceABC) or not conv or not all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
                for m in conv
            ):
                raise TypeError(
                    f"conversation {i} must be a non-empty list of dicts with str 'role' and "
                    "'content'"
                )
        flags = {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
        }
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message=True continues the last message, so it needs "
                "add_generation_prompt=False"
            )
        if chat_template is not None and not isinstance(chat_template, str):
            raise TypeError(
                f"chat_template must be a Jinja template str, got {type(chat_template).__name__}"
            )
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TypeError(
                "chat_template_kwargs must be a dict, "
                f"got {type(chat_template_kwargs).__name__}"
            )
        if self.tokenizer is None or not (
            chat_template or getattr(self.tokenizer, "chat_template", None)
        ):
            raise ValueError(
                f"the tokenizer of {self.model_dir} has no chat template; pass chat_template="
            )
        params = self._normalize_params(sampling_params, len(conversations))
        texts = []
        for i, conv in enumerate(conversations):
            for j, m in enumerate(conv):
                check_unicode(m["content"], f"conversation {i} message {j} content")
            if continue_final_message and conv[-1]["role"] != "assistant":
                raise ValueError(
                    f"conversation {i}: continue_final_message needs a final assistant message, "
                    f"got role {conv[-1]['role']!r}"
                )
            texts.append(
                self.tokenizer.apply_chat_template(
                    conv,
                    chat_template=chat_template,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    **(chat_template_kwargs or {}),
                )
            )
        token_lists = [
            self._tokenize(
                self.tokenizer.encode(t, add_special_tokens=False), i, p.truncate_prompt_tokens
            )
            for i, (t, p) in enumerate(zip(texts, params))
        ]
        params = self._fitted(token_lists, params)
        return self._generate(texts, token_lists, params, use_tqdm)

    def _fitted(
        self, token_lists: list[list[int]], params: list[SamplingParams]
    ) -> list[SamplingParams]:
        """params with max_tokens=None made the room left under max_model_len; each request
        checked to fit the engine alone."""
        params = [
            self._with_max_tokens(p, len(prompt_ids)) for prompt_ids, p in zip(token_lists, params)
        ]
        for i, (prompt_ids, p) in enumerate(zip(token_lists, params)):
            width = p.best_of or p.n
            what = f"sampling_params {'n' if width == p.n else 'best_of'}={width}"
            self._check_group_fits(len(prompt_ids), width, p.max_tokens, what, i)
        return params

    def _generate(
        self,
        prompt_list: list[PromptType],
        token_lists: list[list[int]],
        params: list[SamplingParams],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        outputs: list[RequestOutput | None] = [None] * len(prompt_list)
        for i, out in self._run(prompt_list, token_lists, params, use_tqdm):
            outputs[i] = out
        return outputs

    def _run(
        self,
        prompt_list: list[PromptType],
        token_lists: list[list[int]],
        params: list[SamplingParams],
        use_tqdm: bool,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """Run checked requests; yields (index, final output) as each finishes."""
        groups: list[SequenceGroup] = []
        for prompt_ids, p in zip(token_lists, params):
            if (p.best_of or p.n) > p.n and p.logprobs is None:
                # best_of ranks the samples by cumulative_logprob, which logprobs=0 sets
                p = dataclasses.replace(p, logprobs=0)
            seq = Sequence(prompt_ids, p, request_id=str(self._request_counter))
            self._request_counter += 1
            if p.seed is not None:
                seq.seed = p.seed
            elif not p.greedy:
                seq.seed = self._draw_seed()
            if p.bad_words:
                seq.bad_words_token_ids = bad_words_token_ids(p.bad_words, self.tokenizer)
            groups.append(SequenceGroup(seq.request_id, seq))
        index = {id(g): i for i, g in enumerate(groups)}
        decoder = self._token_decoder()
        for group in self.engine.run_iter(groups, use_tqdm):
            i = index[id(group)]
            p = params[i]
            out = self._request_output(group, prompt_list[i], decoder, p)
            if p.prompt_logprobs is not None:
                rows = group.seqs[0].prompt_logprobs  # scored by the prefill steps
                out.prompt_logprobs = [None, *LazyLogprobs.from_rows(rows, decoder)]
            yield i, out

    def _with_max_tokens(self, p: SamplingParams, prompt_len: int) -> SamplingParams:
        """p, or a copy whose max_tokens=None is made the room left under max_model_len."""
        if p.max_tokens is not None:
            return p
        return dataclasses.replace(p, max_tokens=max(1, self.max_model_len - prompt_len))

    def _token_decoder(self) -> TokenDecoder | None:
        """token ids -> their texts, for Logprob.decoded_token (None without a tokenizer).

        Memoized for the LLM's life: an output with logprobs names k + 1 tokens per generated
        token, mostly the same few thousand; those not seen before are decoded in one batch.
        """
        # The outputs keep this decoder until they are read: it holds the tokenizer and the
        # texts, never the LLM (and so its model and KV cache).
        tokenizer, cache = self.tokenizer, self._decoded_tokens
        if tokenizer is None:
            return None

        def decode(token_ids: list[int]) -> list[str]:
            missing = [tok for tok in set(token_ids) if tok not in cache]
            if missing:
                cache.update(zip(missing, decode_batch(tokenizer, [[t] for t in missing], False)))
            return [cache[tok] for tok in token_ids]

        return decode

    def _draw_seed(self) -> int:
        """The seed of a sampled request that has none: the next of a stream derived from the
        LLM's seed, so the same calls on a new LLM reproduce the same samples."""
        self._num_drawn_seeds += 1
        return xxhash.xxh64_intdigest(f"{self.config.seed}/{self._num_drawn_seeds}".encode())

    def _check_group_fits(
        self, prompt_len: int, width: int, max_tokens: int, what: str, index: int
    ) -> None:
        """A request of `width` sequences must fit the engine alone, or it could never run."""
        limits = {
            "max_num_seqs": self.config.max_num_seqs,
            "max_num_batched_tokens": self.config.max_num_batched_tokens,
        }
        for name, limit in limits.items():
            if width > limit:
                raise ValueError(f"prompts[{index}]: {what} exceeds {name}={limit}")
        bm = self.block_manager
        need = width * bm.num_blocks_for(min(prompt_len + max_tokens, self.max_model_len))
        if need > bm.num_blocks:
            knobs = "kv_cache_memory"
            if self.device.type == "cuda":
                knobs += " or gpu_memory_utilization"
            raise ValueError(
                f"prompts[{index}]: {what} may need {need} KV blocks, more than the cache's "
                f"{bm.num_blocks}; raise {knobs}, or lower max_tokens"
            )

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
            return self._beam_search(prompts, params, use_tqdm)

    def _beam_search(
        self, prompts, params: BeamSearchParams, use_tqdm: bool
    ) -> list[BeamSearchOutput]:
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        params.__post_init__()
        prompt_list = self._normalize_prompts(prompts)
        token_lists = [self._tokenize(p, i) for i, p in enumerate(prompt_list)]
        what = f"beam_width={params.beam_width}"
        for i, ids in enumerate(token_lists):
            self._check_group_fits(len(ids), params.beam_width, params.max_tokens, what, i)
        # Bookkeeping only: beams take their candidates from the raw logprobs.
        sp = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=True)
        groups = []
        for ids in token_lists:
            seq = Sequence(ids, sp, request_id=str(self._request_counter))
            self._request_counter += 1
            groups.append(SequenceGroup(seq.request_id, seq, beam_params=params))
        self.engine.run(groups, use_tqdm)
        decoder = self._token_decoder()
        return [
            BeamSearchOutput(
                sequences=[
                    BeamSearchSequence(
                        tokens=list(ids) + h.token_ids,
                        logprobs=LazyLogprobs.from_rows(h.logprobs, decoder),
                        cum_logprob=h.cumulative_logprob,
                        text=self._decode(list(ids) + h.token_ids, skip_special_tokens=True),
                        finish_reason=h.finish_reason,
                    )
                    for h in group.completed_beams
                ]
            )
            for group, ids in zip(groups, token_lists)
        ]

    def kv_stats(self) -> KVStats:
        """The KV pool now: blocks total/used/shared/cached-free, slot utilization of the used
        blocks, and the peak used/shared blocks of the last generate or beam_search."""
        running = [
            s for g in self.scheduler.running for s in g.seqs_with_status(SequenceStatus.RUNNING)
        ]
        return self.block_manager.kv_stats(running)

    def _decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def _completion(
        self, seq: Sequence, decoder: TokenDecoder | None, p: SamplingParams, index: int
    ) -> CompletionOutput:
        text = getattr(seq, "text", None)
        if text is None:
            text = self._decode(seq.output_token_ids, p.skip_special_tokens)
        with_logprobs = p.logprobs is not None
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=seq.output_token_ids,
            cumulative_logprob=seq.cumulative_logprob if with_logprobs else None,
            logprobs=LazyLogprobs.from_rows(seq.logprobs, decoder) if with_logprobs else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    def _request_output(
        self,
        group: SequenceGroup,
        prompt: PromptType,
        decoder: TokenDecoder | None,
        p: SamplingParams,
    ) -> RequestOutput:
        """The group's RequestOutput for the request's own params p: its n samples in order,
        or with best_of, the n of highest cumulative logprob, best first."""
        seqs = sorted(group.seqs, key=lambda s: s.index)
        first = seqs[0]
        if len(seqs) > p.n:
            seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob)[: p.n]
        return RequestOutput(
            request_id=group.request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=first.token_ids[: first.num_prompt_tokens],
            outputs=[self._completion(s, decoder, p, j) for j, s in enumerate(seqs)],
            finished=group.is_finished,
            num_cached_tokens=first.num_cached_tokens,
        )
