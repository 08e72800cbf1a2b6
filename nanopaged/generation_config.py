"""Default sampling settings from a model's generation_config.json (vLLM's generation_config)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

# The generation_config.json keys vLLM takes as sampling defaults, as SamplingParams names them.
_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def resolve_generation_config(generation_config: str | os.PathLike, model_dir: Path) -> Path | None:
    """The generation_config.json to read: "auto" the model's, "vllm" none, a folder its own."""
    if generation_config == "vllm":
        return None
    if generation_config == "auto":
        folder = model_dir
    elif isinstance(generation_config, (str, os.PathLike)):
        folder = Path(generation_config)
        if not folder.is_dir():
            raise ValueError(
                "generation_config must be 'auto' (the model's generation_config.json), "
                f"'vllm' (none) or a folder holding one, got {str(generation_config)!r}"
            )
    else:
        raise TypeError(
            "generation_config must be 'auto', 'vllm' or a folder path, "
            f"got {type(generation_config).__name__}"
        )
    path = folder / "generation_config.json"
    return path if path.is_file() else None


def load_sampling_defaults(path: Path | None) -> dict[str, float | int]:
    """The sampling fields set in generation_config.json at path (none when path is None)."""
    if path is None:
        return {}
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a valid generation_config.json: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(cfg).__name__}")
    defaults: dict[str, float | int] = {}
    for key in _KEYS:
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
            value
        ):
            raise ValueError(f"{path}: {key} must be a finite number, got {value!r}")
        if key == "top_k":
            if value != int(value):
                raise ValueError(f"{path}: top_k must be an integer, got {value!r}")
            value = int(value)
            value = -1 if value == 0 else value  # HF's 0 means no top-k, as vLLM's -1
        defaults[key] = value
    return defaults
