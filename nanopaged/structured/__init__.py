"""Structured outputs: grammars from StructuredOutputsParams (llguidance), one matcher per
sequence, and the packed token bitmasks the sampler applies inside its kernel.

Imported only when a request asks for structured outputs (the `structured` extra).
"""

from __future__ import annotations

from nanopaged.structured.backend import StructuredBackend
from nanopaged.structured.bitmask import BitmaskFiller, allocate_bitmask, bitmask_words
from nanopaged.structured.grammar import (
    CompiledGrammar,
    GrammarCompiler,
    grammar_of,
    spec_key,
    validate,
)
from nanopaged.structured.matcher import GrammarMatcher
from nanopaged.structured.stats import StructuredStats
from nanopaged.structured.tokenizer import structured_tokenizer

__all__ = [
    "StructuredBackend",
    "StructuredStats",
    "BitmaskFiller",
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarMatcher",
    "allocate_bitmask",
    "bitmask_words",
    "grammar_of",
    "spec_key",
    "structured_tokenizer",
    "validate",
]
