"""Logits -> next tokens: greedy, temperature, top-k, top-p, min-p, seeded noise, logprobs.
(Penalties: kernels/penalties.py, applied by engine/sampling.penalize.)

One call over all rows: the fused Triton kernel on CUDA, its torch reference on CPU (the same
function the kernel tests compare against). Random numbers are keyed by (seed, offset) per row,
so a row's token depends on its own logits and settings only, never on the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from nanopaged.kernels.sampler import FusedSample
from nanopaged.layers.backend import backend_for


@dataclass
class SamplingTensors:
    """Per-row sampling settings of one step, on the logits' device."""

    temperatures: torch.Tensor  # [batch] fp32; 0 = greedy
    top_ks: torch.Tensor  # [batch] int32; <= 0 = off
    top_ps: torch.Tensor  # [batch] fp32; 1 = off
    min_ps: torch.Tensor  # [batch] fp32; 0 = off
    seeds: torch.Tensor  # [batch] int64, the row's random stream
    offsets: torch.Tensor  # [batch] int64, the output position being sampled
    all_greedy: bool = False
    # No row has top-k or top-p: the rows draw in chunks, without a search (sample_fused)
    all_plain: bool = False
    # Some row may have min-p: a chunked draw then finds the rows' maxima first
    any_min_p: bool = True
    # Some row may have top-k: without, rows with top-p draw in chunks too (sample_fused)
    any_top_k: bool = True


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [batch, vocab] -> logits.argmax(dim=-1) on the logits' device: each row's first
    maximum (a NaN counts as the maximum, as in argmax)."""
    return backend_for(logits.device).argmax(logits)


# The sampler's paths, as sample() picks them from a step's flags: argmax; chunked draws
# without a search, with or without the rows' maxima for min-p; the chunked top-p draw of rows
# without top-k; the full kernel. CUDA graphs capture one sampler per path (cuda_graph.py).
SAMPLER_PATHS = ("greedy", "plain", "plain_min_p", "frontier", "full")


def sampler_path(st: SamplingTensors) -> str:
    """Which of SAMPLER_PATHS sample(logits, st) takes without logprobs."""
    if st.all_greedy:
        return "greedy"
    if st.all_plain:
        return "plain_min_p" if st.any_min_p else "plain"
    return "full" if st.any_top_k else "frontier"


def with_path(st: SamplingTensors, path: str) -> SamplingTensors:
    """st's tensors with the flags that make sample() take `path` (one of SAMPLER_PATHS)."""
    if path not in SAMPLER_PATHS:
        raise ValueError(f"sampler path must be one of {SAMPLER_PATHS}, got {path!r}")
    return replace(
        st,
        all_greedy=path == "greedy",
        all_plain=path.startswith("plain"),
        any_min_p=path != "plain",
        any_top_k=path == "full",
    )


def sample(
    logits: torch.Tensor, st: SamplingTensors, num_logprobs: int = 0, need_logprobs: bool = False
) -> FusedSample:
    """logits: [batch, vocab] -> tokens [batch] int64 and their raw logprobs (before
    temperature and filters: computed when need_logprobs or num_logprobs > 0), with the top
    num_logprobs of each row when asked for."""
    if st.all_greedy and num_logprobs == 0 and not need_logprobs:
        tokens = greedy_tokens(logits)
        return FusedSample(tokens, None, None, None)
    args = (logits, st.temperatures, st.top_ks, st.top_ps, st.min_ps, st.seeds, st.offsets)
    return backend_for(logits.device).sample(
        *args, num_logprobs, logprobs=need_logprobs, plain=st.all_plain, min_p=st.any_min_p,
        top_k=st.any_top_k,
    )
