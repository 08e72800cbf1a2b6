"""nanopaged: a minimal offline LLM inference engine on PagedAttention."""

from nanopaged.config import EngineArgs
from nanopaged.engine.llm_engine import LLMEngine
from nanopaged.inputs import TextPrompt, TokensPrompt
from nanopaged.llm import LLM
from nanopaged.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    Logprob,
    RequestOutput,
)
from nanopaged.sampling.output import NonFiniteLogitsError
from nanopaged.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineArgs",
    "RequestOutputKind",
    "NonFiniteLogitsError",
    "SamplingParams",
    "StructuredOutputsParams",
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
