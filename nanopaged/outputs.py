"""What generate and beam_search return (vLLM's class and field names)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability under the model's raw distribution.

    rank: 1 for the most likely token of its position; decoded_token: the token as text.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob (the top-k of that position plus the chosen token).
SampleLogprobs = list[dict[int, Logprob]]
# Prompt positions; the first is None, as no token precedes it to predict it.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" or "length"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's prompt and its completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` and `text` hold the prompt followed by the generated tokens."""

    tokens: list[int]
    logprobs: SampleLogprobs
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best beam_width beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def to_logprobs(
    entries: list[dict[int, float]], ranks: list[dict[int, int]] | None, decode
) -> SampleLogprobs:
    """Engine logprob dicts (token -> float) as Logprob objects with rank and decoded text.

    ranks: per position, token -> its 1-based rank in the raw distribution (None: unknown).
    decode: token id -> str, or None when there is no tokenizer.
    """
    out: SampleLogprobs = []
    for t, entry in enumerate(entries):
        rank_of = ranks[t] if ranks is not None and t < len(ranks) else {}
        out.append(
            {
                tok: Logprob(lp, rank_of.get(tok), decode(tok) if decode is not None else None)
                for tok, lp in entry.items()
            }
        )
    return out
