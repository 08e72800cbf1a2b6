"""User-facing generation parameters, validated on construction."""

from __future__ import annotations

import enum
import json as json_lib
import math
from dataclasses import dataclass

from nanopaged.inputs import check_unicode

# Temperatures below this sample like greedy, and dividing logits by them could overflow.
_MIN_TEMPERATURE = 1e-5


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")


# StructuredOutputsParams' fields, in the order error messages list them.
_STRUCTURED_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's names); set exactly one field.

    json: a JSON schema (a dict, or its text) the output must match; regex: a regular
    expression the whole output must match; choice: the output is one of these strings;
    grammar: a Lark grammar (llguidance's dialect; GBNF is converted); json_object: True for
    any JSON object. The content of a spec (a schema's keywords, a regex, a grammar's rules) is
    checked when a request is made (nanopaged.structured.validate), before any work starts.
    A constrained row's logprobs are those of the masked distribution (disallowed tokens
    -inf), and EOS may end it only where the grammar accepts. Needs the `structured` extra
    (llguidance).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        if self.json is not None:
            if not isinstance(self.json, (str, dict)):
                raise TypeError(
                    f"structured_outputs.json must be a dict or a str (a JSON schema), "
                    f"got {type(self.json).__name__}"
                )
            if isinstance(self.json, str):
                try:
                    schema = json_lib.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
                if not isinstance(schema, (dict, bool)):
                    raise ValueError(
                        "structured_outputs.json must hold a JSON schema (an object), "
                        f"got {type(schema).__name__}"
                    )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(
                    f"structured_outputs.{name} must be a non-empty str, got {value!r}"
                )
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                raise TypeError(
                    "structured_outputs.choice must be a list of str, "
                    f"got {type(self.choice).__name__}"
                )
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(
                    "structured_outputs.choice must be a non-empty list of non-empty str, "
                    f"got {self.choice!r}"
                )
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise TypeError(
                "structured_outputs.json_object must be a bool, "
                f"got {type(self.json_object).__name__}"
            )
        given = [name for name in _STRUCTURED_FIELDS if self._is_set(name)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object (True); got {', '.join(given) if given else 'none'}"
            )

    def _is_set(self, name: str) -> bool:
        value = getattr(self, name)
        return bool(value) if name == "json_object" else value is not None

    @property
    def kind(self) -> str:
        """The field that is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(name for name in _STRUCTURED_FIELDS if self._is_set(name))


def _check_structured_outputs(value: object) -> None:
    if value is not None and not isinstance(value, StructuredOutputsParams):
        raise TypeError(
            "structured_outputs must be a StructuredOutputsParams or None, "
            f"got {type(value).__name__}"
        )


class RequestOutputKind(enum.Enum):
    """What LLMEngine.step() (and LLM.generate_iter(partial=True)) reports of a running request
    (vLLM's names): CUMULATIVE, everything so far at every step; DELTA, only what is new since
    the last report; FINAL_ONLY, nothing until it finishes. generate() returns finals only."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How to sample one request (vLLM's names and defaults).

    n: independent samples of the prompt (prefilled once; the samples share its KV blocks).
    best_of: draw this many samples (>= n; None: n) and return the n of highest
    cumulative_logprob, best first (vLLM's best_of).
    logprobs: per generated token, the top-`logprobs` logprobs plus the sampled token's, from
    the model's raw distribution (log_softmax of the logits before penalties, temperature and
    top-k/p/min-p: vLLM's default "raw_logprobs"); also sets cumulative_logprob. None: neither.
    presence_penalty / frequency_penalty, in [-2, 2]: subtracted from the logit of each token
    once if / as many times as it occurs in the output so far. repetition_penalty > 0: the
    logit of a token seen in the prompt or output is divided by it when positive, multiplied
    when negative (CTRL's penalty). Penalties apply before temperature.
    max_tokens=None: up to max_model_len less the prompt.
    prompt_logprobs: per prompt token, the top-`prompt_logprobs` logprobs plus the token's own
    (RequestOutput.prompt_logprobs; the first entry is None).
    logit_bias (token id -> bias added to its logit), bad_words (words never to complete: the
    last token of a word is banned when the output ends with its other tokens) and
    allowed_token_ids (the only tokens that may be sampled) act on the logits before the
    penalties; logprobs stay those of the raw distribution.
    truncate_prompt_tokens: keep only the last k prompt tokens (-1: the last max_model_len).
    extra_args: a dict kept on the params for the caller's own use; nanopaged reads nothing in it.
    output_kind: what partial outputs report (RequestOutputKind).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
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
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    best_of: int | None = None
    extra_args: dict | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        _check_structured_outputs(self.structured_outputs)
        self._check_counts()
        self._check_filters()
        self._check_lengths()
        self._check_stops()
        self._check_logprobs_and_penalties()
        self._check_logit_controls()

    def _check_counts(self) -> None:
        """The integer and number fields' types, n, best_of, output_kind and extra_args."""
        for name in ("n", "top_k", "min_tokens"):
            _check_int(name, getattr(self, name))
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens)
        for name in ("temperature", "top_p", "min_p"):
            _check_number(name, getattr(self, name))
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.best_of is not None:
            _check_int("best_of", self.best_of)
            if self.best_of < self.n:
                raise ValueError(f"best_of must be >= n ({self.n}) or None, got {self.best_of}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise TypeError(
                "output_kind must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY), "
                f"got {self.output_kind!r}"
            )
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise TypeError(
                f"extra_args must be a dict or None, got {type(self.extra_args).__name__}"
            )

    def _check_filters(self) -> None:
        """temperature (a tiny one is greedy), top_p, top_k, min_p and seed."""
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

    def _check_lengths(self) -> None:
        """The bool flags, max_tokens and min_tokens."""
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be None or >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )

    def _check_stops(self) -> None:
        """stop and stop_token_ids, made lists."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise TypeError(f"stop must be a str or a list of str, got {type(self.stop).__name__}")
        self.stop = list(self.stop or [])
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a non-empty string or a list of them, got {s!r}")
            check_unicode(s, "stop")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise TypeError(
                "stop_token_ids must be a list of int token ids, "
                f"got {type(self.stop_token_ids).__name__}"
            )
        self.stop_token_ids = list(self.stop_token_ids or [])
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must hold ints >= 0, got {t!r}")

    def _check_logprobs_and_penalties(self) -> None:
        """logprobs, prompt_logprobs and the three penalties."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if value < 0:
                    raise ValueError(f"{name} must be None or >= 0, got {value}")
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

    def _check_logit_controls(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError(
                    "logit_bias must be a dict of token id -> bias, "
                    f"got {type(self.logit_bias).__name__}"
                )
            for token, bias in self.logit_bias.items():
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    raise ValueError(f"logit_bias keys must be int token ids >= 0, got {token!r}")
                _check_number(f"logit_bias[{token}]", bias)
                if not math.isfinite(bias):
                    raise ValueError(f"logit_bias[{token}] must be finite, got {bias}")
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or not isinstance(self.bad_words, (list, tuple)):
                raise TypeError(
                    f"bad_words must be a list of str, got {type(self.bad_words).__name__}"
                )
            self.bad_words = list(self.bad_words)
            for w in self.bad_words:
                if not isinstance(w, str) or not w.strip():
                    raise ValueError(f"bad_words must hold non-blank strings, got {w!r}")
                check_unicode(w, "bad_words")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)):
                raise TypeError(
                    "allowed_token_ids must be a list of int token ids, "
                    f"got {type(self.allowed_token_ids).__name__}"
                )
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (None allows every token)")
            for t in self.allowed_token_ids:
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise ValueError(f"allowed_token_ids must hold ints >= 0, got {t!r}")
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens)
            if self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1:
                raise ValueError(
                    "truncate_prompt_tokens must be None, -1 (max_model_len) or >= 1, "
                    f"got {self.truncate_prompt_tokens}"
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

    @property
    def penalties_need_outputs(self) -> bool:
        """Penalties with logprobs: the logprobs are the raw distribution's, which a plain
        step (one logits tensor for the draw and the logprobs) cannot give beside penalized
        draws, so such a row is sampled on its own path (synchronously)."""
        return self.has_penalties and self.logprobs is not None

    @property
    def has_logit_controls(self) -> bool:
        """logit_bias, bad_words or allowed_token_ids: the logits change before sampling."""
        return bool(self.logit_bias) or bool(self.bad_words) or self.allowed_token_ids is not None


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
