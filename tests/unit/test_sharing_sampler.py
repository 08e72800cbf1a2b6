"""Sampling with sharing: penalties equal a plain implementation; forks draw n tokens from
their own streams; logprobs are the raw distribution's top-k plus the sampled token."""

from __future__ import annotations

import math

import pytest
import torch

from nanopaged.engine.sequence import Sequence, SequenceGroup
from nanopaged.kernels.penalties import apply_penalties
from nanopaged.sampling.host import sample_sequences
from nanopaged.sampling.penalties import penalize
from nanopaged.sampling_params import BeamSearchParams, SamplingParams

VOCAB = 30


def _group(prompt, output=(), beam: BeamSearchParams | None = None, **params) -> Sequence:
    seq = Sequence(list(prompt), SamplingParams(**params))
    seq.token_ids += list(output)
    if seq.sampling_params.seed is not None:
        seq.seed = seq.sampling_params.seed
    SequenceGroup("r", seq, beam_params=beam)
    return seq


def _plain_penalties(row, prompt, output, presence, frequency, repetition):
    """vLLM's penalties one token at a time."""
    row = list(row)
    for t in range(len(row)):
        if t in prompt or t in output:
            row[t] = row[t] / repetition if row[t] > 0 else row[t] * repetition
        count = output.count(t)
        row[t] -= frequency * count + presence * (count > 0)
    return row


@pytest.mark.parametrize(
    "presence, frequency, repetition",
    [(0.0, 0.0, 1.3), (0.5, 0.0, 1.0), (0.0, 0.7, 1.0), (-1.5, 2.0, 0.6), (2.0, -2.0, 1.9)],
)
def test_penalties_match_plain_implementation(presence, frequency, repetition):
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 3
    rows = [([1, 2, 3], [4, 4, 4, 5]), ([7], []), ([0, 0, 9], [9, 9, 1, 2, 2, 29])]
    seqs = [
        _group(p, o, presence_penalty=presence, frequency_penalty=frequency,
               repetition_penalty=repetition)  # fmt: skip
        for p, o in rows
    ]
    got = penalize(logits, seqs)
    for i, (p, o) in enumerate(rows):
        expected = _plain_penalties(logits[i].tolist(), p, o, presence, frequency, repetition)
        assert got[i].tolist() == pytest.approx(expected, abs=1e-5)
    assert torch.equal(logits, logits.clone())  # the caller's logits are left alone


def test_penalties_only_touch_rows_that_ask():
    logits = torch.randn(2, VOCAB)
    seqs = [_group([1], [2]), _group([1], [2], repetition_penalty=2.0)]
    got = penalize(logits, seqs)
    assert torch.equal(got[0], logits[0]) and not torch.equal(got[1], logits[1])


def test_apply_penalties_is_vectorised_plain():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    seen = torch.tensor([[True, True, False, True]])
    counts = torch.tensor([[0, 2, 0, 1]])
    out = apply_penalties(
        logits, seen, counts, torch.tensor([0.5]), torch.tensor([0.25]), torch.tensor([2.0])
    )
    assert out.tolist() == [[1.0, -4.0 - 0.5 - 0.5, 1.0, 0.25 - 0.25 - 0.5]]


def test_fork_draws_n_reproducible_distinct_samples():
    logits = torch.zeros(1, VOCAB)  # uniform: samples differ unless the streams coincide
    outs = []
    for _ in range(2):
        parent = _group([1, 2], n=5, seed=11, temperature=1.0)
        outs.append(sample_sequences(logits, [parent], set())[0])
    first, again = outs
    assert len(first.token_ids) == 5 and first.token_ids == again.token_ids
    assert len(set(first.token_ids)) > 2
    # Sample 0 continues the request's own seeded stream, as n = 1 would.
    single = _group([1, 2], seed=11, temperature=1.0)
    assert sample_sequences(logits, [single], set())[0].token_ids == first.token_ids[:1]


def test_logprobs_are_raw_top_k_plus_sampled():
    torch.manual_seed(1)
    logits = torch.randn(2, VOCAB) * 2
    raw = logits.log_softmax(-1)
    seqs = [
        _group([3], [3, 3], logprobs=3, temperature=0.3, repetition_penalty=5.0, seed=0),
        _group([4], logprobs=0, temperature=0),
    ]
    outs = sample_sequences(logits.clone(), seqs, set())
    for out, row in zip(outs, raw):
        token = out.token_ids[0]
        assert out.logprobs == pytest.approx([row[token].item()], abs=1e-6)
    top3 = raw[0].topk(3).indices.tolist()
    d = outs[0].top_logprobs[0]
    assert set(d) == set(top3) | {outs[0].token_ids[0]}
    assert all(math.isclose(v, raw[0, t].item(), abs_tol=1e-6) for t, v in d.items())
    assert outs[1].top_logprobs == [{outs[1].token_ids[0]: outs[1].logprobs[0]}]
    assert outs[1].token_ids == [raw[1].argmax().item()]


def test_beam_rows_get_their_best_candidates():
    torch.manual_seed(2)
    logits = torch.randn(2, VOCAB)
    seqs = [_group([1], beam=BeamSearchParams(beam_width=2, max_tokens=4)), _group([2])]
    beam, plain = sample_sequences(logits, seqs, set())
    values, tokens = logits[0].log_softmax(-1).topk(4)
    assert beam.token_ids == tokens.tolist()
    assert beam.logprobs == pytest.approx(values.tolist())
    assert len(plain.token_ids) == 1 and plain.logprobs is None


def test_min_tokens_still_masks_eos_on_this_path():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 10.0  # EOS would win
    seq = _group([1], min_tokens=2, logprobs=1, temperature=0)
    out = sample_sequences(logits, [seq], {5})[0]
    assert out.token_ids != [5]
