"""Speculative decoding: cheap proposals of the next few tokens that the target model verifies
in one step (the exact rejection sampler that accepts them lives in sampling/rejection.py).

config.py  SpeculativeConfig, parsed from vLLM's speculative_config dict
ngram.py   NgramProposer: prompt lookup over each sequence's prompt and output so far
"""

from nanopaged.spec.config import SPECULATIVE_METHODS, SpeculativeConfig
from nanopaged.spec.ngram import NgramProposer

__all__ = ["SPECULATIVE_METHODS", "NgramProposer", "SpeculativeConfig"]
