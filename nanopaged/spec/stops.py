"""Stop strings in rows that got several tokens in one step (speculative decoding): their
tokens go to the stop matcher one at a time, as steps without speculation would have fed them,
and a sequence keeps its tokens up to the first that completes a stop string."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanopaged.engine.output_processor import StopMatcher
    from nanopaged.engine.sequence import Sequence


def find_stops_token_by_token(
    matcher: StopMatcher, seqs: list[Sequence], num_new_tokens: dict[int, int]
) -> list[tuple[Sequence, int, str, str]]:
    """matcher.find's answer for seqs whose newest num_new_tokens[seq_id] tokens arrived at
    once, taking them one at a time; a sequence with a hit keeps its tokens up to the one that
    completed the stop string (those after it are dropped). A token that leaves the output
    within min_tokens is not searched (nor would it be: see LLMEngine._check_stop_strings)."""
    found = []
    for seq in seqs:
        tokens = seq.token_ids
        num_new = num_new_tokens[seq.seq_id]
        new = tokens[len(tokens) - num_new :]
        del tokens[len(tokens) - num_new :]
        for token in new:
            tokens.append(token)
            if seq.num_output_tokens <= seq.sampling_params.min_tokens:
                continue
            hit = matcher.find([seq])
            if hit:
                found += hit
                break
    return found
