"""Beam search over the engine's sequences: candidates fork their parent, dead beams are freed."""

from __future__ import annotations

from nanopaged.engine.block_manager import BlockManager
from nanopaged.engine.sequence import BeamHypothesis, Sequence, SequenceGroup, SequenceStatus
from nanopaged.sampling.output import SampleOutput


def beam_score(
    num_tokens: int, cumulative_logprob: float, ends_with_eos: bool, length_penalty: float
) -> float:
    """vLLM's score: cumulative logprob / length ** length_penalty.

    The length counts prompt and generated tokens, less a final EOS (as vLLM's
    LLM.beam_search does).
    """
    length = num_tokens - 1 if ends_with_eos else num_tokens
    return cumulative_logprob / (length**length_penalty)


def hypothesis_score(group: SequenceGroup, h: BeamHypothesis) -> float:
    return beam_score(
        group.prompt_len + len(h.token_ids),
        h.cumulative_logprob,
        h.finish_reason == "stop",
        group.beam_params.length_penalty,
    )


def beam_search_step(
    group: SequenceGroup,
    results: list[tuple[Sequence, SampleOutput]],
    eos_token_ids: frozenset[int],
    block_manager: BlockManager,
) -> list[Sequence]:
    """Advance every live beam of group by one token; returns the new live beams, best first.

    Each beam offers its 2 * beam_width most likely next tokens. Candidates ending in EOS (unless
    ignore_eos) are set aside as finished hypotheses; of the rest, the beam_width with the
    highest cumulative logprob live on. A parent chosen once continues in place, chosen again
    it is forked (sharing its blocks), and never chosen it is freed.
    """
    params = group.beam_params
    assert len(results) == len(group.seqs), "every live beam must step together"
    # (cumulative logprob, beam, its output, candidate j of the output)
    candidates: list[tuple[float, Sequence, SampleOutput, int]] = []
    for seq, out in results:
        assert out.logprobs is not None
        # Candidates come best first: out.position(j) ranks candidate j by that place.
        for j, (token, logprob) in enumerate(zip(out.token_ids, out.logprobs)):
            cum = seq.cumulative_logprob + logprob
            if token in eos_token_ids and not params.ignore_eos:
                group.completed_beams.append(
                    BeamHypothesis(
                        token_ids=seq.output_token_ids + [token],
                        cumulative_logprob=cum,
                        logprobs=seq.logprobs + [(out, j)],
                        finish_reason="stop",
                    )
                )
            else:
                candidates.append((cum, seq, out, j))
    # Stable sort: ties keep beam order, then each beam's candidate order.
    candidates.sort(key=lambda c: c[0], reverse=True)
    chosen = candidates[: params.beam_width]

    # A parent chosen once continues in place; each further choice forks it. Forks happen
    # before any parent takes its new token, so a child copies the parent's past only.
    claimed: set[int] = set()
    holders: list[Sequence] = []
    for _, seq, _, _ in chosen:
        if seq.seq_id in claimed:
            child = seq.fork()
            block_manager.fork(seq, child)
            child.group = group
            holders.append(child)
        else:
            claimed.add(seq.seq_id)
            holders.append(seq)
    for holder, (_, _, out, j) in zip(holders, chosen):
        holder.token_ids.append(out.token_ids[j])
        holder.cumulative_logprob += out.logprobs[j]
        holder.logprobs.append((out, j))
    for seq in group.seqs:
        if seq.seq_id not in claimed:
            block_manager.free(seq)
            seq.status = SequenceStatus.FINISHED
    group.seqs = holders  # best first: the order the next step offers candidates in
    return holders


def finalize_beams(group: SequenceGroup, block_manager: BlockManager) -> None:
    """End the search: live beams become hypotheses; keep the best beam_width, best first."""
    for seq in group.seqs:
        group.completed_beams.append(
            BeamHypothesis(
                token_ids=seq.output_token_ids,
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.logprobs),
                finish_reason="length",
            )
        )
        if seq.status == SequenceStatus.RUNNING:
            block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
    group.completed_beams.sort(key=lambda h: hypothesis_score(group, h), reverse=True)
    del group.completed_beams[group.beam_params.beam_width :]
    group.beams_done = True
