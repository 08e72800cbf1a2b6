"""The rejection sampler: greedy chains, the plain sampler's tokens for one-hot drafts, the
target's distribution at each position (chi-square), seeds, and q = p accepting everything."""

from __future__ import annotations

import math

import pytest
import torch

from nanopaged.sampling.ops import sample, sampling_tensors
from nanopaged.sampling.output import DeviceSamples, NonFiniteLogitsError
from nanopaged.sampling.rejection import filtered_probs, rejection_sample
from nanopaged.sampling.speculative import DraftStepHandle
from nanopaged.sampling_params import SamplingParams

CPU = torch.device("cpu")
# (temperature, top_k, top_p, min_p) of the rows of mixed batches.
MIXED = [(0.0, -1, 1.0, 0.0), (1.0, -1, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.2, -1, 0.8, 0.0),
         (0.9, -1, 1.0, 0.1), (0.8, 20, 0.9, 0.05)]  # fmt: skip
PLAIN = (1.0, -1, 1.0, 0.0)


def settings(rows, seeds, offsets):
    """SamplingTensors of rows (temperature, top_k, top_p, min_p), as the Sampler builds them."""
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in rows]
    return sampling_tensors(params, list(seeds), list(offsets), CPU)


def plain_tokens(logits, rows, seeds, offsets, ks):
    """The plain sampler's token at each verified position: [per row, k_i + 1 tokens]."""
    out, start = [], 0
    for row, seed, offset, k in zip(rows, seeds, offsets, ks):
        st = settings([row] * (k + 1), [seed] * (k + 1), [offset + j for j in range(k + 1)])
        out.append(sample(logits[start : start + k + 1], st).token_ids.tolist())
        start += k + 1
    return out


def new_tokens(out):
    return [row[: n + 1] for row, n in zip(out.token_ids.tolist(), out.num_accepted.tolist())]


def test_greedy_rows_accept_while_the_argmax_equals_the_draft():
    gen = torch.Generator().manual_seed(0)
    vocab, ks = 50, [0, 1, 3, 6, 6, 6, 2, 4]
    logits = torch.randn(sum(ks) + len(ks), vocab, generator=gen)
    argmax = logits.argmax(dim=1)
    drafts, want, start = [], [], 0
    for i, k in enumerate(ks):
        # Row i copies the argmax chain for min(i, k) drafts, then deviates.
        chain = argmax[start : start + k + 1].tolist()
        keep = min(i, k)
        drafts += chain[:keep] + [(t + 1) % vocab for t in chain[keep:k]]
        want.append(chain[: keep + 1])
        start += k + 1
    st = settings([MIXED[0]] * len(ks), range(len(ks)), [3] * len(ks))
    draft_ids = torch.tensor(drafts)
    out = rejection_sample(logits, st, draft_ids, ks)
    assert new_tokens(out) == want
    assert out.num_accepted.tolist() == [min(i, k) for i, k in enumerate(ks)]
    assert (out.token_ids == -1).sum() == sum(7 - len(w) for w in want)
    # A draft distribution changes nothing for greedy rows.
    q = torch.softmax(torch.randn(sum(ks), vocab, generator=gen), dim=1)
    again = rejection_sample(logits, st, draft_ids, ks, q)
    assert torch.equal(again.token_ids, out.token_ids)
    picked = [logits[i].tolist() for i in range(len(logits))]
    start = 0
    for i, k in enumerate(ks):
        for j, t in enumerate(want[i]):
            assert out.sampled_logits[i, j].item() == picked[start + j][t]
        start += k + 1


def one_hot_case(seed: int, copies: int, k_step: int, keep_mod: int):
    """A batch of MIXED rows with n-gram-like drafts: (logits, settings, each row's drafts, the
    plain sampler's draw at every verified position, ks); row i's drafts copy the plain
    sampler's chain for min(i % keep_mod, k_i) positions, then deviate."""
    gen = torch.Generator().manual_seed(seed)
    vocab = 64
    rows = MIXED * copies
    ks = [(k_step * i) % 7 for i in range(len(rows))]
    seeds = [1000 + 17 * i for i in range(len(rows))]
    offsets = [i % 5 for i in range(len(rows))]
    logits = torch.randn(sum(ks) + len(ks), vocab, generator=gen) * 2
    plain = plain_tokens(logits, rows, seeds, offsets, ks)
    drafts = []
    for i, (k, chain) in enumerate(zip(ks, plain)):
        keep = min(i % keep_mod, k)
        drafts.append(chain[:keep] + [(t + 1 + i) % vocab for t in chain[keep:k]])
    return logits, settings(rows, seeds, offsets), drafts, plain, ks


def test_one_hot_drafts_give_the_plain_samplers_tokens():
    """For n-gram drafts every new token is the one the plain sampler draws at its position:
    speculation does not change a seeded output."""
    logits, st, drafts, plain, ks = one_hot_case(1, copies=3, k_step=3, keep_mod=4)
    want = [chain[: min(i % 4, k) + 1] for i, (k, chain) in enumerate(zip(ks, plain))]
    out = rejection_sample(logits, st, torch.tensor([t for d in drafts for t in d]), ks)
    assert new_tokens(out) == want


def test_draws_at_every_position_verify_as_the_rejection_sampler():
    """A step sampled in the decode graph brings the plain sampler's draw at every verified
    position (DraftStepHandle.of_draws): with one-hot drafts its new tokens are the rejection
    sampler's, and only the logits of the tokens a row emits are checked for being finite."""
    logits, st, drafts, plain, ks = one_hot_case(2, copies=2, k_step=5, keep_mod=3)
    flat = torch.tensor([t for chain in plain for t in chain])
    draws = DeviceSamples(flat, logits.gather(1, flat[:, None])[:, 0])
    want = new_tokens(rejection_sample(logits, st, torch.tensor([t for d in drafts for t in d]),
                                       ks))  # fmt: skip
    assert DraftStepHandle.of_draws(draws, drafts).result() == want
    # A non-finite logit past a row's new tokens is not its output's: no error.
    row = next(i for i, k in enumerate(ks) if len(want[i]) <= k)
    past = sum(k + 1 for k in ks[:row]) + len(want[row])
    draws.sampled_logits[past] = float("nan")
    assert DraftStepHandle.of_draws(draws, drafts).result() == want
    draws.sampled_logits[past - 1] = float("inf")  # the row's last new token
    with pytest.raises(NonFiniteLogitsError):
        DraftStepHandle.of_draws(draws, drafts).result()


def filtered_ref(x_raw: torch.Tensor, temp: float, top_k: int, top_p: float, min_p: float):
    """The target distribution of one row by sorting (the sampler's documented semantics)."""
    x = x_raw.double() / temp
    order = x.argsort(descending=True)
    keep = torch.zeros_like(x, dtype=torch.bool)
    keep[order[: top_k if top_k > 0 else len(x)]] = True
    e = torch.where(keep, torch.exp(x - x.max()), 0.0)
    above = torch.tensor([e[x > v].sum() for v in x], dtype=torch.float64)
    keep &= above <= top_p * e.sum()
    keep &= x - x.max() >= math.log(min_p) if min_p > 0 else True
    p = torch.where(keep, torch.exp(x - x.max()), 0.0)
    return p / p.sum()


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of counts against probs; cells of probability 0 must be empty."""
    assert counts[probs == 0].sum() == 0
    n = counts.sum()
    live = probs > 0
    expected = probs[live] * n
    stat = ((counts[live] - expected) ** 2 / expected).sum()
    df = int(live.sum()) - 1
    return torch.special.gammaincc(torch.tensor(df / 2), stat / 2).item()


def marginals(table: torch.Tensor, first_prev: int, positions: int) -> torch.Tensor:
    """[positions, vocab]: the distribution of each output position of a chain whose token at
    position t is drawn from table[t, previous token]."""
    m = torch.zeros(table.shape[-1], dtype=torch.float64)
    m[first_prev] = 1.0
    out = []
    for t in range(positions):
        m = m @ table[t]
        out.append(m)
    return torch.stack(out)


@pytest.mark.parametrize("drafts_from", ["one_hot", "draft_model", "draft_model_keyed", "coupled"])
def test_each_position_keeps_the_target_distribution(drafts_from):
    """A chain over 8 tokens whose logits depend on the position and the previous token,
    decoded by speculation with k = 6 for 4,000 seeds; the tokens at output positions 0..5
    follow the target's marginals (chi-square), not the drafts'.

    Drafts: n-gram-like guesses (one-hot q); a draft model's samples, drawn with a generator
    of their own or with the plain sampler's keyed noise (the noise the target's own draw uses
    at that position), verified with their q; the keyed samples verified as one-hot drafts."""
    vocab, k, trials, positions, prompt_last = 8, 6, 4000, 6, 3
    gen = torch.Generator().manual_seed(2)
    horizon = (k + 1) * positions  # the furthest position a step can verify
    target_logits = torch.randn(horizon, vocab, vocab, generator=gen) * 1.5
    row = (0.9, 6, 0.95, 0.02)
    p_table = torch.stack([torch.stack([filtered_ref(target_logits[t, prev], *row)
                                        for prev in range(vocab)]) for t in range(horizon)])
    # The draft model: the target's logits, perturbed, at temperature 1 without filters.
    q_table = torch.softmax(target_logits + torch.randn(horizon, vocab, vocab, generator=gen),
                            dim=-1)  # fmt: skip
    outputs = [[] for _ in range(trials)]
    seeds = [7919 * i + 11 for i in range(trials)]
    accepted = 0
    while min(len(o) for o in outputs) < positions:
        base = torch.tensor([len(o) for o in outputs])
        prev = torch.tensor([o[-1] if o else prompt_last for o in outputs])
        drafts, q_rows, verify = [], [], [prev]
        for j in range(k):
            t = base + j
            if drafts_from == "one_hot":
                # An n-gram-like guess: the target's likeliest token half the time.
                guess = p_table[t, verify[-1]].argmax(dim=1)
                other = torch.randint(0, vocab, (trials,), generator=gen)
                d = torch.where(torch.rand(trials, generator=gen) < 0.5, guess, other)
            else:
                q = q_table[t, verify[-1]]
                if drafts_from == "draft_model":
                    d = torch.multinomial(q, 1, generator=gen)[:, 0]
                else:
                    d = sample(q.log(), settings([PLAIN] * trials, seeds, t.tolist())).token_ids
                if drafts_from != "coupled":
                    q_rows.append(q)
            drafts.append(d)
            verify.append(d)
        # logits: [trials, k + 1, vocab], position j given the drafts before it
        logits = torch.stack([target_logits[base + j, verify[j]] for j in range(k + 1)], dim=1)
        st = settings([row] * trials, seeds, base.tolist())
        q = torch.stack(q_rows, dim=1).reshape(-1, vocab).float() if q_rows else None
        drafts = torch.stack(drafts, dim=1).reshape(-1)
        out = rejection_sample(logits.reshape(-1, vocab), st, drafts, [k] * trials, q)
        accepted += out.num_accepted.sum().item()
        for o, tokens in zip(outputs, new_tokens(out)):
            o += tokens
    # Most steps accepted several drafts, so later positions came from accepted drafts.
    assert accepted > trials
    want = marginals(p_table, prompt_last, positions)
    drafts_only = marginals(q_table.double(), prompt_last, positions)
    for t in range(positions):
        counts = torch.bincount(torch.tensor([o[t] for o in outputs]), minlength=vocab).double()
        assert chi_square_p(counts, want[t]) > 1e-3, (t, counts, want[t] * trials)
        if drafts_from.startswith("draft_model"):
            # The test can tell: the drafts' own distribution is far from what came out.
            assert chi_square_p(counts, drafts_only[t]) < 1e-6, t


def test_drafts_drawn_with_the_keyed_noise_leave_the_residual_unbiased():
    """A draft model that draws with the plain sampler's noise at the position (as the target
    would) must not bias the draw at a rejection: 100,000 one-draft rows see p exactly (with
    the residual drawn from the position's token noise they were off by 0.7% at token 0)."""
    vocab, trials = 6, 100_000
    p_logits = torch.tensor([2.0, 1.5, 0.0, -1.0, 0.5, 1.0])
    q = torch.softmax(torch.tensor([0.0, 2.5, 1.0, -1.0, 2.0, -0.5]), dim=0)
    st = settings([PLAIN] * trials, range(trials), [0] * trials)
    drafts = sample(q.log().expand(trials, vocab).contiguous(), st).token_ids
    logits = p_logits.expand(2 * trials, vocab).contiguous()
    out = rejection_sample(logits, st, drafts, [1] * trials, q.expand(trials, vocab).contiguous())
    assert 0.3 < out.num_accepted.float().mean().item() < 0.9
    counts = torch.bincount(out.token_ids[:, 0], minlength=vocab).double()
    assert chi_square_p(counts, torch.softmax(p_logits.double(), dim=0)) > 1e-3


@pytest.mark.parametrize("with_q", [False, True])
def test_seeded_rows_do_not_depend_on_the_batch(with_q):
    gen = torch.Generator().manual_seed(3)
    vocab = 32
    rows = MIXED
    ks = [4, 0, 6, 3, 5, 2]
    seeds = [5, 6, 7, 8, 9, 10]
    offsets = [0, 4, 2, 9, 1, 30]
    logits = torch.randn(sum(ks) + len(ks), vocab, generator=gen)
    starts = [0] + torch.tensor(ks).add(1).cumsum(0).tolist()
    d_starts = [0] + torch.tensor(ks).cumsum(0).tolist()
    verify = [starts[i] + j for i, k in enumerate(ks) for j in range(k)]
    # Drafts from a distribution near the target's, so that some are accepted.
    q = torch.softmax(logits[verify] * 0.8, dim=1) if with_q else None
    if with_q:
        drafts = torch.multinomial(q, 1, generator=gen)[:, 0]
    else:
        drafts = torch.randint(0, vocab, (sum(ks),), generator=gen)
    st = settings(rows, seeds, offsets)
    whole = rejection_sample(logits, st, drafts, ks, q)
    again = rejection_sample(logits, st, drafts, ks, q)
    assert torch.equal(whole.token_ids, again.token_ids)
    # Each row alone, and the rows in reverse order, give each row the same tokens.
    want = new_tokens(whole)
    for i in range(len(rows)):
        alone = rejection_sample(
            logits[starts[i] : starts[i + 1]], settings([rows[i]], [seeds[i]], [offsets[i]]),
            drafts[d_starts[i] : d_starts[i + 1]], [ks[i]],
            None if q is None else q[d_starts[i] : d_starts[i + 1]],
        )  # fmt: skip
        assert new_tokens(alone) == [want[i]]
    order = list(reversed(range(len(rows))))
    rev = rejection_sample(
        torch.cat([logits[starts[i] : starts[i + 1]] for i in order]),
        settings([rows[i] for i in order], [seeds[i] for i in order], [offsets[i] for i in order]),
        torch.cat([drafts[d_starts[i] : d_starts[i + 1]] for i in order]), [ks[i] for i in order],
        None if q is None else torch.cat([q[d_starts[i] : d_starts[i + 1]] for i in order]),
    )  # fmt: skip
    assert new_tokens(rev) == [want[i] for i in order]
    # Another seed changes the sampled rows' tokens.
    other = rejection_sample(logits, settings(rows, [s + 100 for s in seeds], offsets), drafts,
                             ks, q)  # fmt: skip
    assert new_tokens(other) != want


def test_a_draft_equal_to_the_target_is_always_accepted():
    gen = torch.Generator().manual_seed(4)
    vocab, k = 1000, 5
    rows = MIXED * 4
    seeds = list(range(len(rows)))
    offsets = [3 * i for i in range(len(rows))]
    logits = torch.randn(len(rows) * (k + 1), vocab, generator=gen) * 3
    verify = [r * (k + 1) + j for r in range(len(rows)) for j in range(k)]
    draft_st = settings([r for r in rows for _ in range(k)], [s for s in seeds for _ in range(k)],
                        [o + j for o in offsets for j in range(k)])  # fmt: skip
    q = filtered_probs(logits[verify], draft_st)
    assert torch.allclose(q.sum(dim=1), torch.ones(len(verify)))
    drafts = torch.multinomial(q, 1, generator=gen)[:, 0]
    out = rejection_sample(logits, settings(rows, seeds, offsets), drafts, [k] * len(rows), q)
    assert out.num_accepted.tolist() == [k] * len(rows)
    assert torch.equal(out.token_ids[:, :k], drafts.view(len(rows), k))
    # The bonus token is the plain sampler's at the last position.
    plain = plain_tokens(logits, rows, seeds, offsets, [k] * len(rows))
    assert out.token_ids[:, k].tolist() == [chain[k] for chain in plain]

