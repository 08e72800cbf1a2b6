"""One sequence's matcher: where it stands in its grammar, which tokens may come next."""

from __future__ import annotations

import torch

from nanopaged.structured._llguidance import llguidance


class GrammarMatcher:
    """A sequence's state in its grammar (an llguidance matcher).

    The tokenizer it was compiled with maps the grammar's end to the model's EOS ids: an EOS
    id is allowed only where the grammar accepts, and once the grammar can take nothing more
    (is_terminated) EOS is the only token allowed. A matcher in an error state (a grammar
    past llguidance's limits, a token the mask did not allow) allows only EOS, so its
    sequence ends.
    """

    def __init__(self, matcher: llguidance.LLMatcher, num_words: int, lexer: int = 0) -> None:
        """lexer: which lexer the matcher shares with others (CompiledGrammar's lane); copies
        keep it. Rows of one lexer fill one at a time (its lock), so a batch is ordered by it."""
        self._matcher = matcher
        self.num_words = num_words  # words of a bitmask row: ceil(vocab_size / 32)
        self.lexer = lexer
        # Bumped by every accept and rollback: a mask filled at another version is stale.
        self.version = 0

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (CPU int32 [rows, num_words]; bit
        i % 32 of word i // 32 set = token i allowed)."""
        assert bitmask.dtype == torch.int32, bitmask.dtype  # a host tensor
        assert bitmask.dim() == 2 and bitmask.shape[1] == self.num_words, bitmask.shape
        assert 0 <= row < bitmask.shape[0], (row, bitmask.shape)
        target = bitmask[row]
        assert target.is_contiguous()
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), 4 * self.num_words)

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token. False: the token broke the grammar and the matcher is
        in its error state for good (see error)."""
        matcher = self._matcher
        self.version += 1
        return matcher.consume_token(token_id)

    def accept_many(self, token_ids: list[int]) -> bool:
        """accept() for each token in order; False as soon as one breaks the grammar."""
        matcher = self._matcher
        self.version += 1
        return matcher.consume_tokens(token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (rejected speculative tokens)."""
        assert num_tokens >= 0, num_tokens
        matcher = self._matcher
        self.version += 1
        ok = matcher.rollback(num_tokens)
        assert ok, matcher.get_error()

    def is_terminated(self) -> bool:
        """True when nothing but EOS may follow (the grammar is complete, or in error)."""
        return self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        """True when the output so far is a whole match (EOS is allowed now)."""
        return self._matcher.is_accepting()

    @property
    def error(self) -> str | None:
        """Why the matcher is in its error state; None while it is not."""
        matcher = self._matcher
        return matcher.get_error() if matcher.is_error() else None

    def copy(self) -> GrammarMatcher:
        """An independent matcher at the same place (a forked sample, a beam)."""
        return GrammarMatcher(self._matcher.deep_copy(), self.num_words, self.lexer)

    fork = copy
