"""Speculative decoding: cheap proposals of the next few tokens that the target model verifies
in one step (the exact rejection sampler that accepts them lives in sampling/rejection.py).

config.py  SpeculativeConfig, parsed from vLLM's speculative_config dict
ngram.py   NgramProposer: prompt lookup over each sequence's prompt and output so far
stats.py   SpecStats: acceptance rate and mean accepted length of a run
stops.py   stop strings in a row that got several tokens at once
"""

from __future__ import annotations

from nanopaged.spec.config import SPECULATIVE_METHODS, SpeculativeConfig
from nanopaged.spec.ngram import NgramProposer
from nanopaged.spec.stats import SpecStats

__all__ = ["SPECULATIVE_METHODS", "NgramProposer", "SpecStats", "SpeculativeConfig",
           "proposer_of"]  # fmt: skip


def proposer_of(config: SpeculativeConfig | None) -> tuple[NgramProposer | None, int | None]:
    """(the proposer, disable_by_batch_size) a Scheduler speculates with; (None, None): no
    speculation."""
    if config is None:
        return None, None
    return NgramProposer.from_config(config), config.disable_by_batch_size
