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
    """How to sample one request (vLLM's names and defaults).

    n: independent samples of the prompt (prefilled once; the samples share its KV blocks).
    logprobs: per generated token, the top-`logprobs` logprobs plus the sampled token's, from
    the model's raw distribution (log_softmax of the logits before penalties, temperature and
    top-k/p/min-p: vLLM's default "raw_logprobs"); also sets cumulative_logprob. None: neither.
    presence_penalty / frequency_penalty, in [-2, 2]: subtracted from the logit of each token
    once if / as many times as it occurs in the output so far. repetition_penalty > 0: the
    logit of a token seen in the prompt or output is divided by it when positive, multiplied
    when negative (CTRL's penalty). Penalties apply before temperature.
    """

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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("n", "top_k", "max_tokens", "min_tokens"):
            _check_int(name, getattr(self, name))
        for name in ("temperature", "top_p", "min_p"):
            _check_number(name, getattr(self, name))
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
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
            _check_int("logprobs", self.logprobs)
            if self.logprobs < 0:
                raise ValueError(f"logprobs must be None or >= 0, got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            _check_number(name, getattr(self, name))
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(
                f"repetition_penalty must be a finite number > 0 (1 = none), "
                f"got {self.repetition_penalty}"
            )

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )


@dataclass
class BeamSearchParams:
    """Beam search settings (vLLM's LLM.beam_search).

    Each step every live beam offers its 2 * beam_width most likely next tokens; the
    beam_width best by cumulative logprob live on, candidates ending in EOS (unless ignore_eos)
    are set aside as finished. After max_tokens steps the finished and live beams are ranked by
    cumulative_logprob / length ** length_penalty, length counting prompt and output tokens
    less a final EOS, and the best beam_width are returned.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            _check_int(name, getattr(self, name))
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")
        _check_number("length_penalty", self.length_penalty)
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty}")
