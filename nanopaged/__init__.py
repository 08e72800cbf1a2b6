"""nanopaged: a minimal offline LLM inference engine on PagedAttention."""

from nanopaged.llm import LLM
from nanopaged.outputs import CompletionOutput, RequestOutput
from nanopaged.sampling_params import BeamSearchParams, SamplingParams

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
