"""What the speculative-decoding tests share: outputs reduced to what must match, and the
requests that end on a stop token or max_tokens inside an accepted run of drafts."""

from __future__ import annotations

from nanopaged import SamplingParams


def tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def finishes(outs) -> list[list[tuple]]:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for o in outs]  # fmt: skip


def stop_and_length_requests(prompts, long_run, max_lengths: range):
    """(prompts, params): each prompt stopped by a token its free run emits around position
    3 + 5i (banned before min_tokens), then prompts cut at each of max_lengths."""
    params = []
    for i, [out] in enumerate(long_run):
        at = 3 + 5 * i  # a stop token first seen around here, banned before min_tokens
        params.append(SamplingParams(temperature=0, max_tokens=7 + 6 * i,
                                     stop_token_ids=[out[at]], min_tokens=at - i % 3))  # fmt: skip
    params += [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_lengths]
    prompts = prompts + [prompts[m % len(prompts)] for m in max_lengths]
    return prompts, params
