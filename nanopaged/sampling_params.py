"""User-facing generation parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

# Temperatures below this sample like greedy, and dividing logits by them could overflow.
_MIN_TEMPERATURE = 1e-5


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")


@dataclass
class SamplingParams:
    """How to sample one request (vLLM's names and defaults)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None

    def __post_init__(self) -> None:
        for name in ("n", "top_k", "max_tokens", "min_tokens"):
            _check_int(name, getattr(self, name))
        for name in ("temperature", "top_p", "min_p"):
            _check_number(name, getattr(self, name))
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.n > 1:
            raise NotImplementedError("n > 1 (parallel sampling) is not supported yet")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 means greedy), got {self.temperature}"
            )
        if self.temperature < _MIN_TEMPERATURE:
            self.temperature = 0.0
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not 0 <= self.seed < 2**64:
                raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise TypeError(f"stop must be a str or a list of str, got {type(self.stop).__name__}")
        self.stop = list(self.stop or [])
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a non-empty string or a list of them, got {s!r}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise TypeError(
                "stop_token_ids must be a list of int token ids, "
                f"got {type(self.stop_token_ids).__name__}"
            )
        self.stop_token_ids = list(self.stop_token_ids or [])
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must hold ints >= 0, got {t!r}")
        if self.logprobs is not None:
            raise NotImplementedError("logprobs is not supported yet")

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0 or self.top_k == 1
