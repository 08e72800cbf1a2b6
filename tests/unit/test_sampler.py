"""Sampler: masks equal a plain implementation; seeded rows ignore the rest of the batch."""

from __future__ import annotations

import torch

from nanopaged.layers.sampler import SamplingTensors, apply_top_k_top_p_min_p, sample


def _st(temps, top_ps=None, top_ks=None, min_ps=None, generators=None, vocab=50):
    n = len(temps)
    top_ps = top_ps or [1.0] * n
    top_ks = top_ks or [vocab] * n
    min_ps = min_ps or [0.0] * n
    return SamplingTensors(
        temperatures=torch.tensor(temps, dtype=torch.float32),
        top_ps=torch.tensor(top_ps, dtype=torch.float32),
        top_ks=torch.tensor(top_ks),
        min_ps=torch.tensor(min_ps, dtype=torch.float32),
        generators=generators or [None] * n,
        all_greedy=all(t == 0 for t in temps),
        any_top_p_k=any(p < 1 for p in top_ps) or any(k < vocab for k in top_ks),
        any_min_p=any(m > 0 for m in min_ps),
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
    masked = apply_top_k_top_p_min_p(logits.clone(), st)
    for row, (k, p, m) in enumerate(cases):
        kept = set(torch.nonzero(masked[row] > float("-inf")).flatten().tolist())
        assert kept == _plain_mask(logits[row], k, p, m), (row, k, p, m)


def test_greedy_rows_take_argmax():
    logits = torch.randn(3, 50)
    tokens = sample(logits, _st([0.0, 0.0, 0.0]), None)
    assert tokens.tolist() == logits.argmax(-1).tolist()
    mixed = sample(logits, _st([0.0, 1.0, 0.0]), torch.Generator().manual_seed(0))
    assert mixed[0] == logits[0].argmax() and mixed[2] == logits[2].argmax()


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(2, 50)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        tokens = sample(logits, _st([1.0, 1.0], top_ps=[1.0, 1e-6], top_ks=[1, 50]), g)
        assert tokens.tolist() == logits.argmax(-1).tolist()


def test_seeded_row_independent_of_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)

    def draw(rows, seed_row):
        gens = [torch.Generator().manual_seed(7) if r == seed_row else None for r in rows]
        st = _st([1.0] * len(rows), generators=gens)
        out = sample(logits[rows], st, torch.Generator().manual_seed(len(rows)))
        return out[rows.index(seed_row)].item()

    # The seeded request gets the same token whatever shares its batch.
    seqs = [[draw([0], 0) for _ in range(1)], [draw([2, 0, 1], 0)], [draw([3, 1, 0], 0)]]
    assert seqs[0] == seqs[1] == seqs[2]


def test_samples_follow_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    st = _st([1.0], vocab=3)
    for _ in range(3000):
        counts[sample(logits, st, g)] += 1
    freq = counts / counts.sum()
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)
