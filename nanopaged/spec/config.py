"""SpeculativeConfig: how a run speculates, parsed from vLLM's speculative_config dict."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

# The methods nanopaged implements, by vLLM's names ("draft_model": a separate small model that
# shares the target's tokenizer).
SPECULATIVE_METHODS = ("ngram", "draft_model")
# vLLM's prompt-lookup n when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5
# Above this many running sequences a step does not speculate (the GPU is no longer idle at
# that batch size). Provisional: to be replaced by the batch size measured on an H100 where
# speculation stops paying.
DEFAULT_DISABLE_BY_BATCH_SIZE = 16
_KEYS = {
    "ngram": ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
              "disable_by_batch_size"),
    "draft_model": ("method", "model", "num_speculative_tokens", "disable_by_batch_size"),
}  # fmt: skip


def _int_field(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


@dataclass(frozen=True)
class SpeculativeConfig:
    """A run's speculation: the method, how many tokens each step proposes, and its settings."""

    method: str
    num_speculative_tokens: int
    # ngram: the longest and shortest suffix n-gram looked up in the sequence so far.
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # draft_model: the draft's HF directory or .gguf file (it shares the target's tokenizer).
    model: str | None = None
    # A step with more running sequences than this does not speculate; None: always speculate.
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"method must be one of {', '.join(map(repr, SPECULATIVE_METHODS))}, "
                f"got {self.method!r}"
            )
        _int_field("num_speculative_tokens", self.num_speculative_tokens, 1)
        if self.disable_by_batch_size is not None:
            _int_field("disable_by_batch_size", self.disable_by_batch_size, 1)
        if self.method == "ngram":
            self._check_ngram()
        else:
            self._check_draft_model()

    def _check_ngram(self) -> None:
        if self.model is not None:
            raise ValueError("model applies to method 'draft_model' only, not 'ngram'")
        if self.prompt_lookup_max is None or self.prompt_lookup_min is None:
            raise ValueError("method 'ngram' needs prompt_lookup_max and prompt_lookup_min "
                             "(SpeculativeConfig.from_dict fills vLLM's defaults)")  # fmt: skip
        _int_field("prompt_lookup_max", self.prompt_lookup_max, 1)
        _int_field("prompt_lookup_min", self.prompt_lookup_min, 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min must be <= prompt_lookup_max ({self.prompt_lookup_max}), "
                f"got {self.prompt_lookup_min}"
            )

    def _check_draft_model(self) -> None:
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} applies to method 'ngram' only, not 'draft_model'")
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(
                "method 'draft_model' needs model: the draft's HF directory or .gguf file, "
                f"got {self.model!r}"
            )

    def check_params(self, params: Any, name: str) -> None:
        """Refuse a request's SamplingParams whose options speculation does not support (the
        verifying step samples several positions of a row at once from plain logits): ValueError
        naming the options."""
        refused = [
            field
            for field, used in (
                ("logprobs", params.logprobs is not None),
                ("prompt_logprobs", params.prompt_logprobs is not None),
                ("structured_outputs", params.structured_outputs is not None),
                ("presence_penalty/frequency_penalty/repetition_penalty", params.has_penalties),
                ("logit_bias/allowed_token_ids/bad_words", params.has_logit_controls),
                ("best_of", (params.best_of or params.n) > params.n),
            )
            if used
        ]
        if refused:
            raise ValueError(
                f"{name}: {', '.join(refused)} cannot be used with speculative_config "
                f"(method {self.method!r}); drop them or run without speculative_config"
            )

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> SpeculativeConfig:
        """The config of vLLM's speculative_config dict: {"method": "ngram",
        "num_speculative_tokens": k, "prompt_lookup_max": m, "prompt_lookup_min": n} or
        {"method": "draft_model", "model": path, "num_speculative_tokens": k}; a dict with a
        model and no method means "draft_model", as in vLLM."""
        if not isinstance(config, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(config).__name__}")
        args = dict(config)
        method = args.setdefault("method", "draft_model" if "model" in args else None)
        if method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"method must be one of {', '.join(map(repr, SPECULATIVE_METHODS))}, got {method!r}"
            )
        unknown = sorted(set(args) - set(_KEYS[method]))
        if unknown:
            raise ValueError(
                f"speculative_config with method {method!r} takes "
                f"{', '.join(_KEYS[method])}; got unknown {', '.join(unknown)}"
            )
        if "num_speculative_tokens" not in args:
            raise ValueError("speculative_config needs num_speculative_tokens (an int >= 1)")
        if method == "ngram":
            # vLLM's rule: a missing bound takes the other's value, both missing take 5.
            high, low = args.get("prompt_lookup_max"), args.get("prompt_lookup_min")
            if high is None and low is None:
                high = low = DEFAULT_PROMPT_LOOKUP
            args["prompt_lookup_max"] = low if high is None else high
            args["prompt_lookup_min"] = high if low is None else low
        elif isinstance(args.get("model"), os.PathLike):
            args["model"] = os.fspath(args["model"])
        return cls(**args)


def speculative_config(value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
    """LLM's speculative_config argument as a SpeculativeConfig (None: no speculation)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    return SpeculativeConfig.from_dict(value)
