"""What an engine is built from, resolved and checked before anything loads: the model path,
the engine arguments vLLM scripts pass, the tokenizer (the device: platform.resolve_device)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from nanopaged.quantization import check_quantization_arg

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def resolve_model_dir(
    model: str | os.PathLike | None, gguf_dtype: torch.dtype | None = None
) -> Path:
    """The model directory: a HF directory as it is, a .gguf file converted (cached), None
    for the embedded SmolLM2."""
    from nanopaged.gguf import resolve_model

    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise TypeError(
            f"model must be a path (str or os.PathLike) or None, got {type(model).__name__}"
        )
    return resolve_model(model, gguf_dtype)


def check_engine_args(model: object, trust_remote_code: object, quantization: object) -> None:
    """vLLM engine arguments nanopaged takes only in the values it supports."""
    if trust_remote_code is not False:
        raise ValueError(
            f"trust_remote_code must be False, got {trust_remote_code!r}: nanopaged runs only its "
            "own model code and never imports code shipped beside a model"
        )
    is_gguf = isinstance(model, (str, os.PathLike)) and str(model).endswith(".gguf")
    # The checkpoint's own quantization_config is checked against it when config.json is read.
    check_quantization_arg(quantization, is_gguf)


def check_vllm_args(
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


def load_tokenizer(path: Path, use_fast: bool = True):
    """The Hugging Face tokenizer in path (None for a model directory without one)."""
    if not path.exists():
        raise FileNotFoundError(f"tokenizer path {str(path)!r} does not exist")
    if path.is_dir() and not any((path / f).exists() for f in TOKENIZER_FILES):
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
