"""Speculative decoding: cheap proposals of the next few tokens that the target model verifies
in one step (the exact rejection sampler that accepts them lives in sampling/rejection.py).

config.py  SpeculativeConfig, parsed from vLLM's speculative_config dict
ngram.py   NgramProposer: prompt lookup over each sequence's prompt and output so far
draft.py   DraftProposer: greedy drafts of a second, smaller model with its own paged KV cache
stats.py   SpecStats: acceptance rate and mean accepted length of a run
stops.py   stop strings in a row that got several tokens at once
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanopaged.spec.config import SPECULATIVE_METHODS, SpeculativeConfig
from nanopaged.spec.ngram import NgramProposer
from nanopaged.spec.stats import SpecStats

if TYPE_CHECKING:
    from nanopaged.spec.draft import DraftProposer

__all__ = ["SPECULATIVE_METHODS", "NgramProposer", "SpecStats", "SpeculativeConfig",
           "proposer_of"]  # fmt: skip


def proposer_of(
    config: SpeculativeConfig | None, draft: DraftProposer | None = None
) -> tuple[NgramProposer | DraftProposer | None, int | None]:
    """(the proposer, disable_by_batch_size) a Scheduler speculates with; (None, None): no
    speculation. draft: the loaded draft model of a "draft_model" config (DraftProposer.start)."""
    if config is None:
        return None, None
    if config.method == "draft_model":
        assert draft is not None, "a draft_model config comes with its loaded draft"
        return draft, config.disable_by_batch_size
    return NgramProposer.from_config(config), config.disable_by_batch_size
