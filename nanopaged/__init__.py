"""nanopaged: a minimal offline LLM inference engine on PagedAttention."""

from nanopaged.inputs import TextPrompt, TokensPrompt
from nanopaged.llm import LLM
from nanopaged.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    Logprob,
    RequestOutput,
)
from nanopaged.sampling_params import BeamSearchParams, SamplingParams

__all__ = [
    "LLM",
    "SamplingParams",
    "BeamSearchParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "TextPrompt",
    "TokensPrompt",
]
__version__ = "0.1.0"
