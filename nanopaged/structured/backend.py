"""StructuredBackend: what the sampler holds for structured outputs, one per engine."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import Future

import torch

from nanopaged.sampling_params import StructuredOutputsParams
from nanopaged.structured.bitmask import BitmaskFiller, allocate_bitmask, bitmask_words
from nanopaged.structured.grammar import CompiledGrammar, GrammarCompiler, validate
from nanopaged.structured.matcher import GrammarMatcher
from nanopaged.structured.stats import StructuredStats
from nanopaged.structured.tokenizer import structured_tokenizer


class StructuredBackend:
    """Grammars for one model's tokenizer: validate and compile specs (a thread pool, cached by
    spec), and fill the packed bitmasks of many matchers at once (llguidance's threads)."""

    def __init__(
        self,
        hf_tokenizer,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        compile_workers: int = 2,
        fill_threads: int | None = None,
    ) -> None:
        self.tokenizer = structured_tokenizer(hf_tokenizer, vocab_size, eos_token_ids)
        self.num_words = bitmask_words(self.tokenizer.vocab_size)
        # Compile and mask times, which bench.py reports.
        self.stats = StructuredStats()
        self.filler = BitmaskFiller(self.num_words, fill_threads)
        # A lane (a lexer of its own) per fill thread: a grammar shared by many rows fills on
        # every thread (CompiledGrammar).
        self.compiler = GrammarCompiler(self.tokenizer, self.num_words, compile_workers,
                                        self.stats, num_lanes=self.filler.num_threads)  # fmt: skip

    @staticmethod
    def validate(spec: StructuredOutputsParams) -> None:
        """ValueError naming the field when spec is invalid (grammar.validate)."""
        validate(spec)

    def submit(self, spec: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """Start compiling spec (or find it cached); see GrammarCompiler.submit."""
        return self.compiler.submit(spec)

    def allocate_bitmask(self, rows: int, pin: bool = False) -> torch.Tensor:
        """A host bitmask [rows, num_words] allowing every token."""
        return allocate_bitmask(rows, self.num_words, pin)

    def fill(self, rows: Sequence[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        """Fill bitmask[row] for each (matcher, row), in parallel."""
        self.filler.fill(rows, bitmask)

    def accept(self, rows: Sequence[tuple[GrammarMatcher, list[int]]]) -> None:
        """Advance each (matcher, tokens)'s matcher past its tokens: those with one token (a
        decode step's) in parallel, the others in turn. A token that breaks a grammar leaves
        its matcher in the error state, which allows EOS alone."""
        single = [(m, tokens[0]) for m, tokens in rows if len(tokens) == 1]
        self.filler.accept_one(single)
        for matcher, tokens in rows:
            if len(tokens) > 1:
                matcher.accept_many(tokens)

    def close(self) -> None:
        """Stop the compile threads."""
        self.compiler.close()
