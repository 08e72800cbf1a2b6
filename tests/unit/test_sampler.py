"""Sampler: the allowed set equals a plain implementation; seeded rows ignore the batch; samples
follow the distribution. (The kernel against this reference: tests/kernels.)"""

from __future__ import annotations

import torch

from nanopaged.kernels.sampler import ARGMAX_CHUNK, allowed_mask_ref
from nanopaged.sampling.ops import SamplingTensors, greedy_tokens, sample


def _st(temps, top_ps=None, top_ks=None, min_ps=None, seeds=None, offsets=None):
    n = len(temps)
    return SamplingTensors(
        temperatures=torch.tensor(temps, dtype=torch.float32),
        top_ks=torch.tensor(top_ks or [0] * n, dtype=torch.int32),
        top_ps=torch.tensor(top_ps or [1.0] * n, dtype=torch.float32),
        min_ps=torch.tensor(min_ps or [0.0] * n, dtype=torch.float32),
        seeds=torch.tensor(seeds or [0] * n, dtype=torch.int64),
        offsets=torch.tensor(offsets or [0] * n, dtype=torch.int64),
        all_greedy=all(t == 0 for t in temps),
    )


def _plain_mask(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The tokens that survive, computed the obvious way, one row at a time."""
    order = sorted(range(len(row)), key=lambda i: -row[i].item())[:top_k]
    kept_logits = torch.tensor([row[i].item() for i in order])
    probs = kept_logits.softmax(0).tolist()
    keep, mass = [], 0.0
    for i, p in zip(order, probs):
        if mass > top_p:
            break
        keep.append(i)
        mass += p
    if min_p > 0:
        sub = torch.tensor([row[i].item() for i in keep]).softmax(0)
        keep = [i for i, p in zip(keep, sub.tolist()) if p >= min_p * max(sub.tolist())]
    return set(keep)


def test_masks_match_plain_implementation():
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    cases = [(50, 1.0, 0.0), (5, 1.0, 0.0), (50, 0.5, 0.0), (10, 0.8, 0.0), (50, 1.0, 0.2),
             (7, 0.9, 0.1)]  # fmt: skip
    st = _st([1.0] * 6, [c[1] for c in cases], [c[0] for c in cases], [c[2] for c in cases])
    mask = allowed_mask_ref(logits, st.temperatures, st.top_ks, st.top_ps, st.min_ps)
    for row, (k, p, m) in enumerate(cases):
        kept = set(torch.nonzero(mask[row]).flatten().tolist())
        assert kept == _plain_mask(logits[row], k, p, m), (row, k, p, m)
        for _ in range(3):  # and sampled tokens stay inside it
            st.offsets += 1
            assert sample(logits, st).token_ids[row].item() in kept


def test_greedy_rows_take_argmax():
    logits = torch.randn(3, 50)
    assert sample(logits, _st([0.0, 0.0, 0.0])).token_ids.tolist() == logits.argmax(-1).tolist()
    mixed = sample(logits, _st([0.0, 1.0, 0.0])).token_ids
    assert mixed[0] == logits[0].argmax() and mixed[2] == logits[2].argmax()


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(2, 50)
    for offset in range(5):
        st = _st([1.0, 1.0], top_ps=[1.0, 1e-6], top_ks=[1, 0], offsets=[offset] * 2)
        assert sample(logits, st).token_ids.tolist() == logits.argmax(-1).tolist()


def test_seeded_row_independent_of_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)

    def draw(rows, seed_row):
        seeds = [7 if r == seed_row else 100 + len(rows) for r in rows]
        out = sample(logits[rows], _st([1.0] * len(rows), seeds=seeds, offsets=[3] * len(rows)))
        return out.token_ids[rows.index(seed_row)].item()

    # The seeded request gets the same token whatever shares its batch.
    assert draw([0], 0) == draw([2, 0, 1], 0) == draw([3, 1, 0], 0)


def test_samples_follow_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    counts = torch.zeros(3)
    for offset in range(3000):
        counts[sample(logits, _st([1.0], seeds=[5], offsets=[offset])).token_ids] += 1
    freq = counts / counts.sum()
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_greedy_tokens_equal_argmax():
    """The CPU's chunked search returns argmax's index: the first of tied maxima, the first NaN,
    0 for a row of -inf, in any dtype; vocabularies that do not split into chunks included."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for vocab in (ARGMAX_CHUNK * 7, ARGMAX_CHUNK * 7 + 5):
            logits = torch.randn(6, vocab, generator=g).to(dtype)
            logits[1, [3, ARGMAX_CHUNK + 3, vocab - 1]] = 50.0  # ties across chunks
            logits[2, [ARGMAX_CHUNK + 1, ARGMAX_CHUNK + 9]] = 50.0  # ties inside a chunk
            logits[3, [2 * ARGMAX_CHUNK + 4, 5 * ARGMAX_CHUNK]] = float("nan")
            logits[3, 0] = float("inf")
            logits[4] = float("-inf")
            logits[5, vocab - 1] = float("inf")
            expected = logits.argmax(dim=-1)
            assert expected[1] == 3 and expected[2] == ARGMAX_CHUNK + 1  # argmax's own rule
            assert torch.equal(greedy_tokens(logits), expected)
    assert greedy_tokens(torch.zeros(0, ARGMAX_CHUNK * 2)).shape == (0,)
