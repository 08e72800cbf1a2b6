"""StructuredOutputsParams -> llguidance grammars: checked, compiled in a thread pool, cached."""

from __future__ import annotations

import functools
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from nanopaged.sampling_params import StructuredOutputsParams
from nanopaged.structured._llguidance import llguidance
from nanopaged.structured.matcher import GrammarMatcher
from nanopaged.structured.stats import StructuredStats

# JSON is generated on one line with the usual spaces after "," and ":": no free whitespace,
# which a small model can otherwise spend its whole token budget on.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Compiled grammars kept per tokenizer (a compiled JSON schema holds ~100 KB of lexer state).
CACHE_SIZE = 512
_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON schema",
    "regex": "regular expression",
    "choice": "list of choices",
    "grammar": "grammar",
}


def spec_key(spec: StructuredOutputsParams) -> tuple[str, str]:
    """A hashable key equal for specs that compile to the same grammar."""
    kind = spec.kind
    if kind == "json":
        schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        # Keys keep their order: the properties of an object are generated in it.
        return kind, json.dumps(schema)
    if kind == "choice":
        return kind, json.dumps(list(spec.choice))
    if kind == "json_object":
        return kind, ""
    return kind, getattr(spec, kind)


def _invalid(kind: str, message: str) -> ValueError:
    return ValueError(f"structured_outputs.{kind} is not a valid {_WHAT[kind]}: {message}")


@functools.lru_cache(maxsize=CACHE_SIZE)
def _grammar_of_key(kind: str, text: str) -> str:
    lib = llguidance.LLMatcher
    try:
        if kind == "json":
            return lib.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
        if kind == "json_object":
            return lib.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
        if kind == "regex":
            return lib.grammar_from_regex(text)
        if kind == "choice":
            # Lark string literals take JSON's escapes: each choice is one literal.
            literals = [json.dumps(choice, ensure_ascii=False) for choice in json.loads(text)]
            return lib.grammar_from_lark("start: " + " | ".join(literals))
        assert kind == "grammar", kind
        # Lark as llguidance takes it; GBNF (llama.cpp's) is recognised and converted.
        return llguidance.grammar_from("grammar", text)
    except ValueError as e:
        raise _invalid(kind, str(e)) from None


def grammar_of(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar text of spec (unchecked; validate() checks it)."""
    return _grammar_of_key(*spec_key(spec))


@functools.lru_cache(maxsize=CACHE_SIZE)
def _validate_key(kind: str, text: str) -> None:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        _grammar_of_key(kind, text)
    )
    if is_error:
        raise _invalid(kind, messages[0].strip())


def validate(spec: StructuredOutputsParams) -> None:
    """Raise ValueError naming the field when spec's schema, regex or grammar is invalid;
    no tokenizer needed, so a request processor calls it before any work starts."""
    _validate_key(*spec_key(spec))


class CompiledGrammar:
    """A grammar compiled for one tokenizer: hands each sequence a matcher at its start.

    llguidance's copies of a matcher share its lexer (its lazily built DFA) behind one lock,
    held through a whole mask: one grammar's rows would fill one at a time however many fill
    threads there are. So the grammar keeps `num_lanes` matchers compiled apart (lanes, built
    on first use), and sequences take them in turn: rows of one lane share a warm lexer, rows
    of different lanes fill side by side (BitmaskFiller orders a batch by lane).
    """

    def __init__(
        self,
        kind: str,
        initial: llguidance.LLMatcher,
        num_words: int,
        build: Callable[[], llguidance.LLMatcher] | None = None,
        num_lanes: int = 1,
    ) -> None:
        """initial: the first lane; build: compiles another (None: one lane only)."""
        assert num_lanes >= 1 and (build is not None or num_lanes == 1), num_lanes
        self.kind = kind
        # Never advanced: every matcher is a copy of one of them.
        self._lanes: list[llguidance.LLMatcher | None] = [initial] + [None] * (num_lanes - 1)
        self._build = build
        self._next_lane = 0
        self.num_words = num_words

    @property
    def num_lanes(self) -> int:
        """Matchers compiled apart (each with a lexer of its own) that sequences take in turn."""
        return len(self._lanes)

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start, on the next lane (called from one thread)."""
        lane = self._next_lane
        self._next_lane = (lane + 1) % len(self._lanes)
        initial = self._lanes[lane]
        if initial is None:  # ~0.5 ms for a JSON schema; at most num_lanes - 1 per grammar
            initial = self._lanes[lane] = self._build()
        return GrammarMatcher(initial.deep_copy(), self.num_words, lexer=id(initial))


class GrammarCompiler:
    """Compiles specs for one tokenizer in a thread pool (llguidance drops the GIL while it
    builds a grammar), keeping the most recent CACHE_SIZE compiled grammars by spec."""

    def __init__(
        self,
        tokenizer: llguidance.LLTokenizer,
        num_words: int,
        max_workers: int = 2,
        stats: StructuredStats | None = None,
        num_lanes: int = 1,
    ) -> None:
        """stats: where each compile's wall time is counted (default: a StructuredStats of
        its own); num_lanes: each grammar's lanes (CompiledGrammar), the fill threads'."""
        self.tokenizer = tokenizer
        self.num_words = num_words
        self.num_lanes = num_lanes
        self.stats = StructuredStats() if stats is None else stats
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="nanopaged-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()

    def submit(self, spec: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """A future of spec's compiled grammar: the cached one, else a compile started now;
        its result() raises the ValueError of an invalid spec."""
        key = spec_key(spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, key)
            self._cache[key] = future
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """spec's compiled grammar, waiting for it."""
        return self.submit(spec).result()

    def _compile(self, key: tuple[str, str]) -> CompiledGrammar:
        kind, text = key
        started = time.perf_counter()
        _validate_key(kind, text)
        grammar = _grammar_of_key(kind, text)
        build = functools.partial(llguidance.LLMatcher, self.tokenizer, grammar, log_level=0)
        initial = build()
        if initial.is_error():
            raise _invalid(kind, initial.get_error().strip())
        # list.append from the pool's threads: atomic under the GIL
        self.stats.compile_seconds.append(time.perf_counter() - started)
        return CompiledGrammar(kind, initial, self.num_words, build, self.num_lanes)

    def close(self) -> None:
        """Stop the pool's threads; compiles not yet started are cancelled."""
        self._pool.shutdown(wait=True, cancel_futures=True)
