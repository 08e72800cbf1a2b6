"""What generate and beam_search return (vLLM's class and field names)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import overload


@dataclass
class Logprob:
    """One token's log-probability under the model's raw distribution.

    rank: 1 for the most likely token of its position; decoded_token: the token as text.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# token ids -> the text of each one (Logprob.decoded_token), in order.
TokenDecoder = Callable[[list[int]], list[str]]

# Positions whose Logprob dicts one decode call serves while iterating.
_POSITIONS_PER_BUILD = 64


class LazyLogprobs(SequenceABC):
    """A list[dict[int, Logprob]] that makes a position's dict when it is first read.

    It keeps the engine's raw logprobs of each position (token -> logprob, token -> rank), so
    an output with logprobs costs nothing until it is read: a position's Logprob objects are
    made and its tokens decoded on first access, then kept. Indexing and iteration give those
    dicts, a slice a plain list of them, and it compares equal to a list holding the same
    dicts. It pickles with the texts of its tokens in place of the decoder.
    """

    def __init__(
        self,
        entries: list[dict[int, float]],
        ranks: list[dict[int, int]] | None = None,
        decode: TokenDecoder | None = None,
    ) -> None:
        """entries: per position, token -> raw logprob; ranks: per position, token -> its
        1-based rank (None, or a position past its end: unknown); decode: None without a
        tokenizer (decoded_token stays None)."""
        self._entries = entries
        self._ranks = ranks
        self._decode = decode
        self._built: list[dict[int, Logprob] | None] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    @overload
    def __getitem__(self, index: int) -> dict[int, Logprob]: ...

    @overload
    def __getitem__(self, index: slice) -> list[dict[int, Logprob]]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            positions = range(len(self._entries))[index]
            built = self._build(positions)
            return [built[t] for t in positions]
        t = operator.index(index)
        n = len(self._entries)
        if t < 0:
            t += n
        if not 0 <= t < n:
            raise IndexError(f"logprobs index {index} out of range for {n} positions")
        built = self._built
        if built is None or built[t] is None:
            built = self._build((t,))
        return built[t]

    def __iter__(self) -> Iterator[dict[int, Logprob]]:
        n = len(self._entries)
        for start in range(0, n, _POSITIONS_PER_BUILD):
            stop = min(start + _POSITIONS_PER_BUILD, n)
            yield from self._build(range(start, stop))[start:stop]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (list, LazyLogprobs)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]  # mutable dicts inside, as a list

    def __repr__(self) -> str:
        return repr(list(self))

    def __copy__(self) -> LazyLogprobs:
        new = LazyLogprobs(self._entries, self._ranks, self._decode)
        if self._built is not None:
            new._built = list(self._built)
        return new

    def __reduce__(self):
        # The decoder may hold a tokenizer (or be a closure): carry the texts it would give
        # the positions not built yet instead.
        decode = self._decode
        if decode is not None:
            built = self._built
            unbuilt = (
                range(len(self._entries))
                if built is None
                else (t for t, d in enumerate(built) if d is None)
            )
            ids = list({tok for t in unbuilt for tok in self._entries[t]})
            decode = KnownTexts(dict(zip(ids, decode(ids))))
        return (LazyLogprobs, (self._entries, self._ranks, decode), {"_built": self._built})

    def _build(self, positions: Iterable[int]) -> list[dict[int, Logprob] | None]:
        """Make the Logprob dicts of those positions that have none yet, decoding all their
        tokens in one call; returns every position's dict so far (None: not made)."""
        built = self._built
        if built is None:
            built = self._built = [None] * len(self._entries)
        todo = [t for t in positions if built[t] is None]
        if not todo:
            return built
        entries, ranks = self._entries, self._ranks
        num_ranked = 0 if ranks is None else len(ranks)
        texts = None
        if self._decode is not None:
            texts = iter(self._decode([tok for t in todo for tok in entries[t]]))
        for t in todo:
            rank_of = ranks[t] if t < num_ranked else {}
            if texts is None:
                built[t] = {tok: Logprob(lp, rank_of.get(tok)) for tok, lp in entries[t].items()}
            else:
                built[t] = {
                    tok: Logprob(lp, rank_of.get(tok), next(texts))
                    for tok, lp in entries[t].items()
                }
        return built


class KnownTexts:
    """A TokenDecoder over texts decoded before: what a pickled LazyLogprobs carries."""

    def __init__(self, texts: dict[int, str]) -> None:
        self.texts = texts

    def __call__(self, token_ids: list[int]) -> list[str]:
        return [self.texts[tok] for tok in token_ids]


# Per generated position: token id -> Logprob (the top-k of that position plus the chosen
# token). Outputs of the engine hold a LazyLogprobs; a plain list is the same to users.
SampleLogprobs = LazyLogprobs | list[dict[int, Logprob]]
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
