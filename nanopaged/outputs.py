"""What generate and beam_search return (vLLM's class and field names)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import Protocol, overload


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

# One generated position's raw logprobs: its tokens (the top-k plus the chosen token, each
# once, in the order of its dict), their raw logprobs, and their 1-based ranks (None: unknown).
RawLogprobs = tuple[list[int], list[float], list[int | None]]


class LogprobRows(Protocol):
    """Raw logprobs of several positions kept together (the rows of one step's samples, the
    tokens of a SampleOutput); `position(row)` reads one row's when it is asked for."""

    def position(self, row: int) -> RawLogprobs: ...


# Positions whose Logprob dicts one decode call serves while iterating.
_POSITIONS_PER_BUILD = 64


class _DictPositions:
    """Raw positions given as dicts: per position, token -> logprob, and token -> rank (ranks
    None, or shorter than entries: the ranks of the positions past its end are unknown)."""

    def __init__(self, entries: list[dict[int, float]], ranks: list[dict[int, int]] | None):
        self.entries = entries
        self.ranks = ranks

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, t: int) -> RawLogprobs:
        entry, ranks = self.entries[t], self.ranks
        rank_of = ranks[t] if ranks is not None and t < len(ranks) else {}
        tokens = list(entry)
        return tokens, list(entry.values()), [rank_of.get(tok) for tok in tokens]

    def as_dicts(self) -> tuple[list[dict[int, float]], list[dict[int, int]] | None]:
        return self.entries, self.ranks


class _RowPositions:
    """Raw positions given as references (rows, row), each read from its rows when asked."""

    def __init__(self, rows: list[tuple[LogprobRows, int]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, t: int) -> RawLogprobs:
        rows, row = self.rows[t]
        return rows.position(row)

    def as_dicts(self) -> tuple[list[dict[int, float]], list[dict[int, int]] | None]:
        entries, ranks = [], []
        for rows, row in self.rows:
            tokens, logprobs, token_ranks = rows.position(row)
            entries.append(dict(zip(tokens, logprobs)))
            ranks.append({t: r for t, r in zip(tokens, token_ranks) if r is not None})
        return entries, ranks


class LazyLogprobs(SequenceABC):
    """A list[dict[int, Logprob]] that makes a position's dict when it is first read.

    It keeps the engine's raw logprobs of each position (dicts, or references to the rows of
    the steps that sampled them), so an output with logprobs costs nothing until it is read:
    a position's Logprob objects are made and its tokens decoded on first access, then kept.
    Indexing and iteration give those dicts, a slice a plain list of them, and it compares
    equal to a list holding the same dicts. It pickles as raw dicts (not the steps' rows,
    which other requests share), with the texts of its tokens in place of the decoder.
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
        self._positions: _DictPositions | _RowPositions = _DictPositions(entries, ranks)
        self._decode = decode
        self._built: list[dict[int, Logprob] | None] | None = None

    @classmethod
    def from_rows(
        cls, rows: list[tuple[LogprobRows, int]], decode: TokenDecoder | None = None
    ) -> LazyLogprobs:
        """rows: per position, (the rows holding its raw logprobs, its row among them), as a
        sequence records them while it generates; the list is kept, not copied."""
        new = cls.__new__(cls)
        new._positions = _RowPositions(rows)
        new._decode = decode
        new._built = None
        return new

    def __len__(self) -> int:
        return len(self._positions)

    @overload
    def __getitem__(self, index: int) -> dict[int, Logprob]: ...

    @overload
    def __getitem__(self, index: slice) -> list[dict[int, Logprob]]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            positions = range(len(self._positions))[index]
            built = self._build(positions)
            return [built[t] for t in positions]
        t = operator.index(index)
        n = len(self._positions)
        if t < 0:
            t += n
        if not 0 <= t < n:
            raise IndexError(f"logprobs index {index} out of range for {n} positions")
        built = self._built
        if built is None or built[t] is None:
            built = self._build((t,))
        return built[t]

    def __iter__(self) -> Iterator[dict[int, Logprob]]:
        n = len(self._positions)
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
        new = LazyLogprobs.__new__(LazyLogprobs)
        new._positions = self._positions
        new._decode = self._decode
        new._built = None if self._built is None else list(self._built)
        return new

    def __reduce__(self):
        # The decoder may hold a tokenizer (or be a closure): carry the texts it would give
        # the positions not built yet instead.
        entries, ranks = self._positions.as_dicts()
        decode = self._decode
        if decode is not None:
            built = self._built
            unbuilt = (
                range(len(entries))
                if built is None
                else (t for t, d in enumerate(built) if d is None)
            )
            ids = list({tok for t in unbuilt for tok in entries[t]})
            decode = KnownTexts(dict(zip(ids, decode(ids))))
        return (LazyLogprobs, (entries, ranks, decode), {"_built": self._built})

    def _build(self, positions: Iterable[int]) -> list[dict[int, Logprob] | None]:
        """Make the Logprob dicts of those positions that have none yet, decoding all their
        tokens in one call; returns every position's dict so far (None: not made)."""
        built = self._built
        if built is None:
            built = self._built = [None] * len(self._positions)
        todo = [t for t in positions if built[t] is None]
        if not todo:
            return built
        raw = [self._positions[t] for t in todo]
        if self._decode is None:
            for t, (tokens, logprobs, ranks) in zip(todo, raw):
                built[t] = {tok: Logprob(lp, r) for tok, lp, r in zip(tokens, logprobs, ranks)}
            return built
        texts = iter(self._decode([tok for tokens, _, _ in raw for tok in tokens]))
        for t, (tokens, logprobs, ranks) in zip(todo, raw):
            built[t] = {
                tok: Logprob(lp, r, next(texts)) for tok, lp, r in zip(tokens, logprobs, ranks)
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
