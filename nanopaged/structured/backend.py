"""StructuredBackend: what the sampler holds for structured outputs, one per engine."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from nanopaged.sampling_params import StructuredOutputsParams
from nanopaged.structured.bitmask import BitmaskFiller, allocate_bitmask, bitmask_words
from nanopaged.structured.grammar import CompiledGrammar, GrammarCompiler, validate
from nanopaged.structured.matcher import GrammarMatcher
from nanopaged.structured.stats import StructuredStats
from nanopaged.structured.tokenizer import structured_tokenizer

# The interpreter's GIL switch interval while matchers advance on the backend's thread. That
# thread needs the GIL for a few microseconds between llguidance's calls; at Python's default
# (5 ms) it waited that long for the engine's thread, which runs Python all the while.
ADVANCE_SWITCH_INTERVAL_S = 5e-5


def _lexer_of_row(row: tuple[GrammarMatcher, object]) -> int:
    return row[0].lexer


class StructuredBackend:
    """Grammars for one model's tokenizer: validate and compile specs (a thread pool, cached by
    spec), and fill the packed bitmasks of many matchers at once (llguidance's threads).

    Masks are filled ahead: accept() hands a step's tokens to a thread of the backend's, which
    advances the matchers and fills their next masks into a host buffer (the stage) on
    llguidance's threads, without the GIL, while the engine finishes the step and plans the
    next. wait() joins it; masks() waits for it, then hands the staged rows out, filling only
    the matchers not covered (new sequences, preempted ones back). No other call may touch
    the matchers of an accept() in between.
    """

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
        self.pin = False  # the stage in page-locked memory (masks copied to a GPU): see masks()
        self._stage: torch.Tensor | None = None
        # The matchers whose masks the stage holds: id -> (matcher, stage row, version).
        self._staged: dict[int, tuple[GrammarMatcher, int, int]] = {}
        # The copy out of the stage that the sampler queued last (CUDA event; None: none
        # pending). The stage is written again only once it is done.
        self.stage_read: torch.cuda.Event | None = None
        self._advancing = ThreadPoolExecutor(1, thread_name_prefix="nanopaged-matchers")
        self._advance: Future | None = None  # the accept() in flight
        self._switch_interval = sys.getswitchinterval()  # the interpreter's, restored by wait()

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
        """Start advancing each (matcher, tokens)'s matcher past its tokens, then filling their
        next masks ahead, on the backend's thread (see the class). wait() joins it."""
        self.wait()
        if not rows:
            return
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, ADVANCE_SWITCH_INTERVAL_S))
        self._advance = self._advancing.submit(self._accept, list(rows))

    def wait(self) -> None:
        """Wait for the last accept(); raises what it raised."""
        advance, self._advance = self._advance, None
        if advance is None:
            return
        try:
            advance.result()
        finally:
            sys.setswitchinterval(self._switch_interval)

    def _accept(self, rows: list[tuple[GrammarMatcher, list[int]]]) -> None:
        """accept()'s work: those with one token (a decode step's) in parallel, the others in
        turn. A token that breaks a grammar leaves its matcher in the error state, which
        allows EOS alone. Then their next masks are filled ahead. One order for both passes:
        rows of one lexer together (see BitmaskFiller)."""
        started = time.perf_counter()
        rows = sorted(rows, key=_lexer_of_row)
        single = []
        for matcher, tokens in rows:
            if len(tokens) == 1:
                matcher.version += 1
                single.append((matcher, tokens[0]))
            else:
                matcher.accept_many(tokens)
        self.filler.accept_one(single)
        self.stats.accept_seconds += time.perf_counter() - started
        self.fill_ahead([m for m, _ in rows])

    def fill_ahead(self, matchers: Sequence[GrammarMatcher]) -> None:
        """Fill matchers' next masks into the stage now (row k: matchers[k]; rows of one lexer
        best together), for the next masks() to hand out."""
        if not matchers:
            return
        started = time.perf_counter()
        if self._stage is None or self._stage.shape[0] < len(matchers):
            self._stage = self.allocate_bitmask(2 * len(matchers), self.pin)
        elif self.stage_read is not None:  # a copy still reading the stage: let it finish
            self.stage_read.synchronize()
        self.stage_read = None
        self._staged = {id(m): (m, k, m.version) for k, m in enumerate(matchers)}
        self.filler.fill_rows(matchers, self._stage)
        self.stats.prefetch_seconds += time.perf_counter() - started

    def masks(
        self, matchers: Sequence[GrammarMatcher], pin: bool = False
    ) -> tuple[torch.Tensor, list[int]]:
        """Each matcher's mask for its next token: (host words [num_masks, num_words], each
        matcher's row in them). Rows filled ahead at the matcher's version are used as they
        are; the others are filled now, in parallel, in the rows after them.
        pin: the host rows in page-locked memory (for copies to a GPU), from now on."""
        self.wait()
        if pin != self.pin:
            self.pin, self._stage, self._staged = pin, None, {}
        rows, missing = [], []
        used = len(self._staged)
        for matcher in matchers:
            staged = self._staged.get(id(matcher))
            if staged is not None and staged[0] is matcher and staged[2] == matcher.version:
                rows.append(staged[1])
            else:
                rows.append(used + len(missing))
                missing.append(matcher)
        need = used + len(missing)
        if self._stage is None or self._stage.shape[0] < need:
            grown = self.allocate_bitmask(2 * need, self.pin)
            if used:
                grown[:used] = self._stage[:used]
            self._stage = grown
        if missing:
            if self.stage_read is not None:  # a copy still reading the stage: let it finish
                self.stage_read.synchronize()
            pairs = sorted(((m, used + k) for k, m in enumerate(missing)), key=_lexer_of_row)
            self.fill(pairs, self._stage)
        # Rows of sequences not in this step stay behind: a copy of [:need] carries them.
        return self._stage[:need], rows

    def close(self) -> None:
        """Stop the compile threads and the matchers' thread."""
        try:
            self.wait()
        finally:
            self._advancing.shutdown()
            self.compiler.close()
