"""StructuredBackend: what the sampler holds for structured outputs, one per engine."""

from __future__ import annotations

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


class StructuredBackend:
    """Grammars for one model's tokenizer: validate and compile specs (a thread pool, cached by
    spec), and fill the packed bitmasks of many matchers at once (llguidance's threads).

    Masks are filled ahead: once accept() moved a step's matchers on, their next masks fill
    into a host buffer (the stage) on a thread of their own while the engine finishes the
    step (outputs, stop strings, admissions); masks() then hands them out, filling only the
    matchers the prefetch did not cover (new sequences, preempted ones back).
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
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="nanopaged-masks")
        self._stage: torch.Tensor | None = None
        # The matchers whose masks the last prefetch fills: id -> (matcher, stage row, version).
        self._staged: dict[int, tuple[GrammarMatcher, int, int]] = {}
        self._prefetch: Future | None = None
        # The copy out of the stage that the sampler queued last (CUDA event; None: none
        # pending). The stage is written again only once it is done.
        self.stage_read: torch.cuda.Event | None = None

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
        for matcher, _ in rows:
            matcher.settle()
        self.filler.fill(rows, bitmask)

    def accept(self, rows: Sequence[tuple[GrammarMatcher, list[int]]]) -> None:
        """Advance each (matcher, tokens)'s matcher past its tokens: those with one token (a
        decode step's) in parallel, the others in turn. A token that breaks a grammar leaves
        its matcher in the error state, which allows EOS alone. Then their next masks start
        filling (the prefetch)."""
        started = time.perf_counter()
        for matcher, _ in rows:
            matcher.settle()
        single = [(m, tokens[0]) for m, tokens in rows if len(tokens) == 1]
        for matcher, _ in single:
            matcher._moved()
        self.filler.accept_one(single)
        for matcher, tokens in rows:
            if len(tokens) > 1:
                matcher.accept_many(tokens)
        for matcher, _ in rows:
            matcher.note_stopped()  # read while the prefetch holds the matcher
        self.stats.accept_seconds += time.perf_counter() - started
        self.prefetch([m for m, _ in rows])

    def prefetch(self, matchers: Sequence[GrammarMatcher]) -> None:
        """Start filling matchers' next masks into the stage on the prefetch thread; each
        matcher is busy until it is done."""
        self._settle_prefetch()
        if not matchers:
            return
        if self._stage is None or self._stage.shape[0] < len(matchers):
            self._stage = self.allocate_bitmask(2 * len(matchers), self.pin)
        self._staged = {id(m): (m, k, m.version) for k, m in enumerate(matchers)}
        rows = [(m, k) for k, m in enumerate(matchers)]
        self._prefetch = self._prefetcher.submit(self._fill_stage, rows, self.stage_read)
        self.stage_read = None
        for matcher in matchers:
            matcher.busy = self._prefetch

    def _fill_stage(self, rows: list[tuple[GrammarMatcher, int]], read) -> float:
        started = time.perf_counter()
        if read is not None:
            read.synchronize()
        self.filler.fill(rows, self._stage)
        return time.perf_counter() - started

    def _settle_prefetch(self) -> None:
        if self._prefetch is not None:
            self.stats.prefetch_seconds += self._prefetch.result()
            self._prefetch = None

    def masks(
        self, matchers: Sequence[GrammarMatcher], pin: bool = False
    ) -> tuple[torch.Tensor, list[int]]:
        """Each matcher's mask for its next token: (host words [num_masks, num_words], each
        matcher's row in them). Rows the prefetch filled at the matcher's version are used
        as they are; the others are filled now, in parallel, in the rows after them.
        pin: the host rows in page-locked memory (for copies to a GPU), from now on."""
        self._settle_prefetch()
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
            self.fill([(m, used + k) for k, m in enumerate(missing)], self._stage)
        # Rows of sequences not in this step stay behind: a copy of [:need] carries them.
        return self._stage[:need], rows

    def close(self) -> None:
        """Stop the compile and prefetch threads."""
        self._prefetcher.shutdown(wait=True)
        self.compiler.close()
