"""The sort-based sampler the engine ran before the fused one: the baseline of sampler_bench.

It sorts every row of logits for top-k/top-p and draws seeded rows from per-request
torch.Generators, one Python call per row."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingTensors:
    """Per-row sampling settings of one step, on the logits' device."""

    temperatures: torch.Tensor  # [batch] fp32; 0 = greedy
    top_ps: torch.Tensor  # [batch] fp32
    top_ks: torch.Tensor  # [batch] int64; vocab size when disabled
    min_ps: torch.Tensor  # [batch] fp32
    generators: list[torch.Generator | None]  # a request's own generator when it has a seed
    all_greedy: bool
    any_top_p_k: bool
    any_min_p: bool


def apply_top_k_top_p_min_p(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Mask (to -inf) the tokens that top-k, then top-p, then min-p exclude."""
    if st.any_top_p_k:
        # sorted_logits: [batch, vocab], descending
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        sorted_logits.masked_fill_(ranks[None, :] >= st.top_ks[:, None], float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass.
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits.masked_fill_(mass_before > st.top_ps[:, None], float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)
    if st.any_min_p:
        probs = logits.softmax(dim=-1)
        threshold = st.min_ps[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor, st: SamplingTensors, generator: torch.Generator | None
) -> torch.Tensor:
    """logits: [batch, vocab] -> tokens [batch] int64."""
    logits = logits.float()
    greedy_tokens = logits.argmax(dim=-1)
    if st.all_greedy:
        return greedy_tokens
    is_greedy = st.temperatures == 0
    temperatures = torch.where(is_greedy, torch.ones_like(st.temperatures), st.temperatures)
    logits = apply_top_k_top_p_min_p(logits / temperatures[:, None], st)
    probs = logits.softmax(dim=-1)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p. Each seeded row draws its
    # noise from its own generator, so its tokens do not depend on the rest of the batch.
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(st.generators) if g is None]
    if len(unseeded) == len(st.generators):
        noise.exponential_(generator=generator)
    else:
        for i, g in enumerate(st.generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        if unseeded:
            rows = torch.tensor(unseeded, device=probs.device)
            noise[rows] = torch.empty_like(noise[rows]).exponential_(generator=generator)
    # An exact 0 would turn p / E into inf (or NaN for a masked token) and win the race.
    noise.clamp_min_(torch.finfo(noise.dtype).tiny)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(is_greedy, greedy_tokens, sampled)
