"""The rejection sampler through the Triton kernels (as on a GPU) against its CPU path."""

from __future__ import annotations

import torch

from nanopaged.layers import backend as backend_module
from nanopaged.sampling import ops, rejection
from nanopaged.sampling.ops import sampling_tensors
from nanopaged.sampling.rejection import rejection_sample
from nanopaged.sampling_params import SamplingParams

# (temperature, top_k, top_p, min_p): greedy, plain, each filter, all of them
ROWS = [(0.0, -1, 1.0, 0.0), (1.0, -1, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.2, -1, 0.8, 0.0),
        (0.9, -1, 1.0, 0.1), (0.8, 20, 0.9, 0.05)]  # fmt: skip


def test_triton_paths_give_the_reference_tokens(monkeypatch):
    """One-hot drafts (the fused sampler, the argmax) and draft-model drafts (the chunked draws
    of the residual and of the two-way accept, keyed past the vocabulary)."""
    gen = torch.Generator().manual_seed(5)
    vocab, ks = 64, [3, 0, 2, 3, 1, 2]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in ROWS]
    st = sampling_tensors(params, list(range(40, 46)), [0, 1, 2, 3, 4, 5], torch.device("cpu"))
    logits = torch.randn(sum(ks) + len(ks), vocab, generator=gen) * 2
    q = torch.softmax(torch.randn(sum(ks), vocab, generator=gen), dim=1)
    drafts = torch.multinomial(q, 1, generator=gen)[:, 0]
    want = [rejection_sample(logits, st, drafts, ks, q_) for q_ in (None, q)]
    assert sum(w.num_accepted.sum().item() for w in want) > 0
    for module in (ops, rejection):
        monkeypatch.setattr(module, "backend_for", lambda device, dtype=None: backend_module.TRITON)
    for expected, q_ in zip(want, (None, q)):
        got = rejection_sample(logits, st, drafts, ks, q_)
        assert torch.equal(got.token_ids, expected.token_ids)
        assert torch.equal(got.num_accepted, expected.num_accepted)
