"""Logit controls: bias adds, allowed_token_ids masks the rest, bad words ban their last token
only after their other tokens; requests with controls leave the fast sampler."""

from __future__ import annotations

import torch

from nanopaged.engine.sequence import Sequence, SequenceGroup
from nanopaged.logits_processors import apply_logit_controls
from nanopaged.sampling.host import sample_sequences
from nanopaged.sampling.rows import StepRows
from nanopaged.sampling_params import SamplingParams

VOCAB = 12
INF = float("inf")


def _seq(output=(), bad_words_ids=(), **params) -> Sequence:
    seq = Sequence([1, 2], SamplingParams(**params))
    seq.token_ids += list(output)
    seq.bad_words_token_ids = [list(w) for w in bad_words_ids]
    SequenceGroup("r", seq)
    return seq


def test_controls_on_their_rows_only():
    logits = torch.randn(4, VOCAB)
    seqs = [
        _seq(logit_bias={3: 5.0, 4: -2.5}),
        _seq(allowed_token_ids=[0, 7]),
        _seq(output=[5, 6], bad_words=["x", "y"], bad_words_ids=[[9], [6, 8], [5, 10]]),
        _seq(),
    ]
    out = apply_logit_controls(logits, seqs)
    expected = logits.clone()
    expected[0, 3] += 5.0
    expected[0, 4] -= 2.5
    expected[1, [i for i in range(VOCAB) if i not in (0, 7)]] = -INF
    expected[2, [9, 8]] = -INF  # 9 alone; 8 follows the output's last token 6; 10 needs a 5 last
    assert torch.equal(out, expected)
    assert not torch.equal(logits, out)  # the input stays as it was


def test_bias_does_not_revive_a_masked_token_and_forces_its_token():
    seq = _seq(allowed_token_ids=[1, 2], logit_bias={5: 100.0, 2: 100.0}, temperature=0)
    out = apply_logit_controls(torch.zeros(1, VOCAB), [seq])
    assert out[0, 5] == -INF and out[0, 2] == 100.0
    assert StepRows.of([seq]).host
    (sampled,) = sample_sequences(torch.zeros(1, VOCAB), [seq], set())
    assert sampled.token_ids == [2]


def test_plain_requests_keep_the_fast_path():
    assert not StepRows.of([_seq(temperature=0)]).host
    assert StepRows.of([_seq(bad_words=["a"])]).host
