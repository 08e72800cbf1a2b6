"""The exact rejection sampler of speculative decoding, on the logits' device.

A speculating row proposes k draft tokens d_0..d_{k-1} for its next output positions and the
target model scores k + 1 positions in one step: row j of its logits is the target's
distribution p_j at output position base + j (base: the row's output tokens so far), given the
drafts before j. The row keeps the longest prefix of drafts the sampler accepts, then one more
token: the correction at the first rejected position, or a bonus token from p_k when all k are
accepted. Every output token is distributed exactly as the target would sample it without
speculation (Leviathan et al., 2023; Chen et al., 2023).

p_j is what the plain sampler draws from: the raw logits over temperature, cut by top-k, top-p
and min-p (kernels/sampler.allowed_mask_ref), renormalized; a greedy row's is one-hot at its
argmax. The noise is the plain sampler's, keyed by (row seed, output position): the target's
own draw at a position is the Gumbel-max sample y_j that the plain sampler would take there.

- Greedy rows, and drafts with q one-hot (the n-gram proposer's, draft_probs=None): accept d_j
  iff y_j == d_j; the first mismatch and the bonus are y_j. For q one-hot this is the rejection
  rule itself: y_j == d_j has probability p_j(d_j) = min(1, p/q), and y_j given y_j != d_j is
  distributed as normalize(max(0, p_j - q_j)). Every output token is then bit for bit the token
  the plain sampler would draw from the same logits at that position: seeded outputs do not
  depend on speculation (up to the verifying step's logits rounding differently from a decode
  step's).
- Sampled rows with a draft distribution q (a draft model's, draft_probs): accept d_j with
  probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw from
  normalize(max(0, p_j - q_j)); the bonus is y_k. The accept draw (two-way) and the residual
  draw use the noise of token ids past the vocabulary (vocab, vocab + 1; vocab + 2 ..) at the
  position, which no token draw uses: the draft model may draw d_j with the plain sampler's
  keyed noise at that position (a draft drawn with it tells which tokens' noise was low, and a
  residual drawn with it too came out biased). The output keeps the target's distribution and
  is reproducible for a seed whatever the batch, but accepted drafts are the draft model's
  draws, so it is not the token sequence of a run without speculation. A draft model that
  draws with the plain sampler's keyed noise and passes draft_probs=None instead is verified
  as one-hot drafts: bit-identical outputs, at a lower acceptance rate (both draws share the
  noise, so they agree often when q is near p, and always when q = p).

Penalties, min_tokens masks, logit controls and grammar masks are the caller's: each verified
position's logits row must come with them applied as they would be at that position.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from nanopaged.kernels.sampler import allowed_mask_ref
from nanopaged.layers.backend import backend_for
from nanopaged.platform import to_device
from nanopaged.sampling.ops import SamplingTensors, greedy_tokens, sample


@dataclass
class RejectionOutput:
    """The new tokens of each speculating row, on the logits' device."""

    # [batch, max_k + 1] int64: row i's new tokens are its first num_accepted[i] + 1 entries
    # (the accepted drafts, then the correction or bonus token); -1 after them.
    token_ids: torch.Tensor
    num_accepted: torch.Tensor  # [batch] int64, drafts accepted (0 .. k_i)
    # [batch, max_k + 1] fp32: each new token's raw logit at its position, for the step's
    # finite-logits check; 0 after the new tokens.
    sampled_logits: torch.Tensor


@dataclass
class _Layout:
    """Where each row's verified positions and drafts sit in the flat inputs (device tensors)."""

    row_of: torch.Tensor  # [num_logits] the row of each logits row
    pos_of: torch.Tensor  # [num_logits] its position j in the row, 0 .. k_i
    logit_idx: torch.Tensor  # [batch, K + 1] the logits row of (row, min(j, k_i))
    draft_idx: torch.Tensor  # [batch, K] the draft of (row, min(j, k_i - 1)); 0 when k_i = 0
    draft_rows: torch.Tensor  # [num_drafts] the logits row that verifies each draft
    valid: torch.Tensor  # [batch, K] bool, j < k_i
    max_k: int


def _layout(num_draft_tokens: list[int], device: torch.device) -> _Layout:
    # Built on the host from the scheduler's counts, copied to the device in one transfer.
    counts = np.asarray(num_draft_tokens, dtype=np.int64)
    batch, max_k = len(counts), int(counts.max(initial=0))
    starts = np.cumsum(counts + 1) - (counts + 1)
    draft_starts = np.cumsum(counts) - counts
    row_of = np.repeat(np.arange(batch), counts + 1)
    pos_of = np.arange(len(row_of)) - starts[row_of]
    j = np.arange(max_k + 1)
    logit_idx = starts[:, None] + np.minimum(j[None, :], counts[:, None])
    num_drafts = int(counts.sum())
    last = np.maximum(counts - 1, 0)[:, None]
    # A row without drafts after the last draft would point past the end: any valid index does.
    draft_idx = np.minimum(draft_starts[:, None] + np.minimum(j[None, :max_k], last),
                           max(num_drafts - 1, 0))  # fmt: skip
    draft_row = np.repeat(np.arange(batch), counts)  # the row of each draft
    draft_rows = starts[draft_row] + np.arange(num_drafts) - draft_starts[draft_row]
    valid = (j[None, :max_k] < counts[:, None]).astype(np.int64)
    parts = [row_of, pos_of, logit_idx.ravel(), draft_idx.ravel(), draft_rows, valid.ravel()]
    flat = to_device(np.concatenate(parts), device)
    row_of, pos_of, logit_idx, draft_idx, draft_rows, valid = flat.split([len(p) for p in parts])
    return _Layout(
        row_of=row_of,
        pos_of=pos_of,
        logit_idx=logit_idx.view(batch, max_k + 1),
        draft_idx=draft_idx.view(batch, max_k),
        draft_rows=draft_rows,
        valid=valid.view(batch, max_k).bool(),
        max_k=max_k,
    )


def _rows_of(st: SamplingTensors, rows: torch.Tensor, pos: torch.Tensor) -> SamplingTensors:
    """The settings of rows `rows` of st, each at output position offset + pos."""
    return replace(
        st,
        temperatures=st.temperatures[rows],
        top_ks=st.top_ks[rows],
        top_ps=st.top_ps[rows],
        min_ps=st.min_ps[rows],
        seeds=st.seeds[rows],
        offsets=st.offsets[rows] + pos,
    )


def _unfiltered(st: SamplingTensors) -> SamplingTensors:
    """st's noise (seeds, offsets) for draws from given logits: temperature 1, no filters."""
    ones = torch.ones_like(st.temperatures)
    return SamplingTensors(
        temperatures=ones,
        top_ks=torch.zeros_like(st.top_ks),
        top_ps=ones,
        min_ps=torch.zeros_like(st.min_ps),
        seeds=st.seeds,
        offsets=st.offsets,
        all_plain=True,
        any_min_p=False,
        any_top_k=False,
    )


def filtered_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The distribution the plain sampler draws each row of logits ([rows, vocab]) from, fp32:
    softmax of logits / temperature over the tokens top-k, top-p and min-p allow; one-hot at
    the argmax for a greedy row."""
    allowed = allowed_mask_ref(logits, st.temperatures, st.top_ks, st.top_ps, st.min_ps)
    greedy = st.temperatures == 0
    temps = torch.where(greedy, torch.ones_like(st.temperatures), st.temperatures)
    x = logits.float() * (1.0 / temps.float())[:, None]
    probs = x.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, greedy_tokens(logits)[:, None], 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def _private_draw(logits: torch.Tensor, st: SamplingTensors, first_id: int) -> torch.Tensor:
    """[rows] the Gumbel-max draw from logits rows (temperature 1, no filters) with the noise
    of token ids first_id.. at each row's (seed, position): ids past the vocabulary, which no
    token draw at that position uses (a draft model may draw with the plain sampler's)."""
    u = _unfiltered(st)
    return backend_for(logits.device).sample(
        logits, u.temperatures, u.top_ks, u.top_ps, u.min_ps, u.seeds, u.offsets, 0, first_id,
        logprobs=False, plain=True, min_p=False, top_k=False,
    ).token_ids  # fmt: skip


def _accept_draws(
    p_draft: torch.Tensor, q_draft: torch.Tensor, st: SamplingTensors, vocab: int
) -> torch.Tensor:
    """[num_drafts] bool: each draft accepted with probability min(1, p / q), a two-way draw
    with the noise of ids vocab and vocab + 1 at its row's (seed, position)."""
    # A draft its own distribution could not have drawn (q = 0) is accepted when p allows it.
    ratio = torch.where(q_draft > 0, p_draft / q_draft.clamp_min(1e-30), (p_draft > 0).float())
    accept = ratio.clamp(0.0, 1.0)
    # choices: [num_drafts, 2] = log-odds of accepting, of rejecting
    choices = torch.stack([accept.log(), torch.log1p(-accept)], dim=1)
    return _private_draw(choices, st, vocab) == 0


def _draft_model_fixes(
    logits: torch.Tensor,
    st: SamplingTensors,
    drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    target: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted [num_drafts] bool, token at a rejection [num_drafts]) of drafts drawn from
    draft_probs, verified by logits rows [num_drafts, vocab] with settings st; target: the
    plain sampler's draw at each position (what a greedy row keeps)."""
    vocab = logits.shape[-1]
    p = filtered_probs(logits, st)
    q = draft_probs.float()
    p_draft = p.gather(1, drafts[:, None])[:, 0]
    q_draft = q.gather(1, drafts[:, None])[:, 0]
    accepted = _accept_draws(p_draft, q_draft, st, vocab)
    residual = (p - q).clamp_min(0.0)
    # p and q equal up to rounding leave no residual mass: then p itself (a rejection there
    # has probability ~0 anyway).
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
    # Not the position's token noise: a draft drawn with it would bias the residual draw (the
    # draft being d says the noise of tokens likely under q was low).
    fixes = _private_draw(residual.log(), st, vocab + 2)
    greedy = st.temperatures == 0
    accepted = torch.where(greedy, target == drafts, accepted)
    return accepted, torch.where(greedy, target, fixes)


def rejection_sample(
    logits: torch.Tensor,
    st: SamplingTensors,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list[int],
    draft_probs: torch.Tensor | None = None,
) -> RejectionOutput:
    """Verify each row's drafts against the target's logits (see the module docstring).

    logits: [sum(k_i + 1), vocab], row i's k_i + 1 verified positions one after another, rows
    in order. st: one row of settings per speculating row, its offset the output position of
    the row's first verified token (the plain sampler's offset for that row this step).
    draft_token_ids: [sum(k_i)] int64, row i's k_i drafts one after another; num_draft_tokens:
    k_i per row (0: the row samples one token as usual). draft_probs: [sum(k_i), vocab], the
    distribution each draft was drawn from; None: the drafts are one-hot proposals (n-gram)."""
    batch, num_drafts = len(num_draft_tokens), sum(num_draft_tokens)
    assert logits.dim() == 2 and logits.shape[0] == num_drafts + batch, logits.shape
    assert draft_token_ids.shape == (num_drafts,), (draft_token_ids.shape, num_drafts)
    assert st.seeds.shape == (batch,), (st.seeds.shape, batch)
    assert draft_probs is None or draft_probs.shape == (num_drafts, logits.shape[1])
    dev = logits.device
    lay = _layout(num_draft_tokens, dev)
    k = lay.max_k
    # target: [sum(k_i + 1)], the plain sampler's token at every verified position
    target = sample(logits, _rows_of(st, lay.row_of, lay.pos_of)).token_ids
    fixes = target[lay.logit_idx]  # [batch, K + 1]
    drafts = draft_token_ids.long()
    if draft_probs is None or k == 0 or st.all_greedy:
        accepted = target[lay.draft_rows] == drafts
    else:
        draft_st = _rows_of(st, lay.row_of[lay.draft_rows], lay.pos_of[lay.draft_rows])
        accepted, draft_fixes = _draft_model_fixes(
            logits[lay.draft_rows], draft_st, drafts, draft_probs, target[lay.draft_rows]
        )
        fixes[:, :k] = torch.where(lay.valid, draft_fixes[lay.draft_idx], fixes[:, :k])
    accepted = accepted[lay.draft_idx] & lay.valid  # [batch, K]
    padded_drafts = drafts[lay.draft_idx]
    # Drafts count up to the first rejection.
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    j = torch.arange(k + 1, device=dev)[None, :]
    padded_drafts = torch.cat([padded_drafts, torch.zeros_like(fixes[:, :1])], dim=1)
    n = num_accepted[:, None]
    token_ids = torch.where(j < n, padded_drafts, torch.where(j == n, fixes, -1))
    picked = logits[lay.logit_idx, token_ids.clamp_min(0)].float()
    sampled_logits = torch.where(j <= n, picked, 0.0)
    return RejectionOutput(token_ids, num_accepted, sampled_logits)
