"""What the runner hands back per sampled sequence when a plain token id is not enough."""

from __future__ import annotations

from dataclasses import dataclass

# A plain step's raw logprobs for one row: the sampled token's, the top-k plus the sampled
# token's {id: logprob}, and their 1-based ranks {id: rank}.
RowLogprobs = tuple[float, dict[int, float], dict[int, int]]


@dataclass
class SampleOutput:
    """One sequence's logits row turned into tokens.

    token_ids: the sampled token; n tokens for a parent about to fork into n samples; the
    2 * beam_width best candidates for a beam. logprobs: each token's logprob under the model's
    raw distribution. top_logprobs: per token, the row's top-k logprobs plus that token's.
    top_ranks: per token, the 1-based rank of each token of top_logprobs in the raw distribution.
    """

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    top_ranks: list[dict[int, int]] | None = None
