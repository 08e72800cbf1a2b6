"""Stop strings in a row that got several tokens in one step (speculative decoding): the
sequence keeps its tokens up to the first that completes a stop string, as it would have
stopped there had they come one step at a time."""

from __future__ import annotations

from typing import TYPE_CHECKING

from nanopaged.engine.output_processor import _place_stop as place_stop

if TYPE_CHECKING:
    from nanopaged.engine.sequence import Sequence


def drop_after_stop(seq: Sequence, num_new: int, tokenizer) -> tuple[int, str, str]:
    """Cut seq's tokens after the first of its num_new newest tokens whose output text holds
    a stop string; returns (index in the output text, the stop string, the output text) at
    that token. Asked only of a sequence whose full output holds one (StopMatcher.find)."""
    tokens = seq.token_ids
    new = tokens[len(tokens) - num_new :]
    del tokens[len(tokens) - num_new :]
    for token in new:
        tokens.append(token)
        found = place_stop(seq, tokenizer)
        if found:
            _, idx, stop, full = found[0]
            return idx, stop, full
    raise AssertionError("the full output holds a stop string")  # invariant
