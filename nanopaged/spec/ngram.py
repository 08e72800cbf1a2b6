"""The n-gram proposer (prompt lookup): the tokens that followed the latest earlier occurrence
of the sequence's longest repeated suffix.

For a sequence t[0..L-1] and n from prompt_lookup_max down to prompt_lookup_min (n < L): if the
suffix t[L-n..L-1] occurred earlier, starting at some s < L - n (overlaps allowed), the
proposal is t[s+n .. s+n+k-1] for the largest such s, cut at the end of the sequence; the
first n that matches decides. No match: no proposal.

Each sequence keeps an index, a dict from each n-gram (a tuple of token ids) to the end
position of its latest occurrence, which grows by the tokens that arrived since the last call:
a step costs the new tokens' n-grams and a few lookups, never a scan of the context (memory:
prompt_lookup_max - prompt_lookup_min + 1 entries per token). Tuples sliced from the token
list (built in bulk by zip, a C loop) measured as fast as numpy's byte views of int64 windows
for the bulk build and twice as fast per step, so numpy is not used.
Measured on this project's 2-core CPU machine (Python 3.11, load average ~7 from other jobs,
so upper bounds), on a 4,096-token context with repeats: indexing it from scratch takes 2.6 ms
for n = 1..5 (0.6 ms for n = 5 alone), once per sequence; a step that appends 1 token and
proposes takes ~5 us per sequence, one that appends 7 tokens ~16 us.
"""

from __future__ import annotations

from nanopaged.spec.config import SpeculativeConfig

# Up to this many new n-gram ends are indexed one by one; more, in bulk per n.
_FEW = 16


class _NgramIndex:
    """The latest end position of each n-gram of one sequence's tokens so far."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        # n-gram -> end position of its latest occurrence, over the ends < num_indexed
        self.table: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0
        self.num_tokens = 0
        self.last_token: int | None = None  # tokens[num_tokens - 1], to tell a stale index

    def extends(self, tokens: list[int]) -> bool:
        """Whether tokens continue the tokens this index has seen."""
        seen = self.num_tokens
        return len(tokens) >= seen and (seen == 0 or tokens[seen - 1] == self.last_token)

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams that tokens (a continuation of those seen) add; those that end at
        the last token stay out, so a lookup never finds the suffix itself."""
        first, stop = self.num_indexed, len(tokens) - 1  # n-gram ends to add: first .. stop - 1
        table = self.table
        if stop - first <= _FEW:
            for last in range(first, stop):
                for n in range(self.min_n, min(self.max_n, last + 1) + 1):
                    table[tuple(tokens[last - n + 1 : last + 1])] = last
        else:
            for n in range(self.min_n, self.max_n + 1):
                lo = max(first, n - 1)
                # The n-grams ending at lo .. stop - 1 as tuples, oldest first so that a later
                # occurrence overwrites an earlier one: column i is tokens[end - n + 1 + i].
                grams = zip(*(tokens[lo - n + 1 + i : stop - n + 1 + i] for i in range(n)))
                table.update(zip(grams, range(lo, stop)))
        self.num_indexed = max(first, stop)
        self.num_tokens = len(tokens)
        self.last_token = tokens[-1] if tokens else None

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens after the latest earlier occurrence of the longest suffix n-gram
        (tokens: those last passed to extend)."""
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = self.table.get(tuple(tokens[length - n :]))
            if end is not None:
                return tokens[end + 1 : end + 1 + k]
        return []


class NgramProposer:
    """Proposes up to k next tokens per sequence by prompt lookup (see the module docstring)."""

    def __init__(
        self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int
    ) -> None:
        # The values come from a checked SpeculativeConfig (or a test).
        assert 1 <= prompt_lookup_min <= prompt_lookup_max, (prompt_lookup_min, prompt_lookup_max)
        assert num_speculative_tokens >= 1, num_speculative_tokens
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self._indexes: dict[int, _NgramIndex] = {}

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> NgramProposer:
        """The proposer of an "ngram" SpeculativeConfig."""
        assert config.method == "ngram", config.method
        return cls(config.num_speculative_tokens, config.prompt_lookup_max,
                   config.prompt_lookup_min)  # fmt: skip

    def propose(
        self, seqs_tokens: list[list[int]], seq_ids: list[int] | None = None
    ) -> list[list[int]]:
        """Each sequence's proposal (0 to k tokens) from its token ids (prompt + output).

        seq_ids: keep each sequence's index across calls under its id, so that a call costs
        only the tokens that arrived since the last one (a sequence's tokens only grow; free()
        drops the index when it leaves). None: a throwaway index per sequence."""
        if seq_ids is None:
            seq_ids = [None] * len(seqs_tokens)
        assert len(seq_ids) == len(seqs_tokens), (len(seq_ids), len(seqs_tokens))
        out = []
        for tokens, seq_id in zip(seqs_tokens, seq_ids):
            index = None if seq_id is None else self._indexes.get(seq_id)
            # An index that tokens do not continue belongs to another sequence (an id reused
            # after a missed free()): start over.
            if index is None or not index.extends(tokens):
                index = _NgramIndex(self.min_n, self.max_n)
                if seq_id is not None:
                    self._indexes[seq_id] = index
            index.extend(tokens)
            out.append(index.lookup(tokens, self.k))
        return out

    def free(self, seq_id: int) -> None:
        """Drop the index of a sequence that finished or left (no-op if it has none)."""
        self._indexes.pop(seq_id, None)

    def free_all(self) -> None:
        """Drop every sequence's index (after a failed step)."""
        self._indexes.clear()
