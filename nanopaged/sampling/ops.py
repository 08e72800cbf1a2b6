"""Logits -> next tokens: greedy, temperature, top-k, top-p, min-p, seeded noise, logprobs.
(Penalties: kernels/penalties.py, applied by sampling/penalties.penalize.)

One call over all rows: the fused Triton kernel on CUDA, its torch reference on CPU (the same
function the kernel tests compare against). Random numbers are keyed by (seed, offset) per row,
so a row's token depends on its own logits and settings only, never on the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from nanopaged.kernels.sampler import FusedSample
from nanopaged.layers.backend import backend_for
from nanopaged.platform import pinned
from nanopaged.sampling.rows import RowClass, classify
from nanopaged.sampling_params import SamplingParams


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


@dataclass
class TokenMask:
    """Structured outputs' allowed tokens for some rows of a step, on the logits' device."""

    words: torch.Tensor  # [num_masks, ceil(vocab / 32)] int32: bit t % 32 of word t // 32 = t
    rows: torch.Tensor  # [batch] int32: each row's mask in words, -1 for none


def greedy_tokens(logits: torch.Tensor, mask: TokenMask | None = None) -> torch.Tensor:
    """logits [batch, vocab] -> logits.argmax(dim=-1) on the logits' device: each row's first
    maximum (a NaN counts as the maximum, as in argmax), among its allowed tokens (mask)."""
    if mask is None:
        return backend_for(logits.device).argmax(logits)
    return backend_for(logits.device).argmax(logits, bitmask=mask.words, bitmask_rows=mask.rows)


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
    logits: torch.Tensor,
    st: SamplingTensors,
    num_logprobs: int = 0,
    need_logprobs: bool = False,
    mask: TokenMask | None = None,
) -> FusedSample:
    """logits: [batch, vocab] -> tokens [batch] int64 and their raw logprobs (before
    temperature and filters: computed when need_logprobs or num_logprobs > 0), with the top
    num_logprobs of each row when asked for. mask: rows' allowed tokens (structured outputs);
    a masked row's logprobs are those of its masked distribution."""
    if st.all_greedy and num_logprobs == 0 and not need_logprobs:
        tokens = greedy_tokens(logits, mask)
        return FusedSample(tokens, None, None, None)
    args = (logits, st.temperatures, st.top_ks, st.top_ps, st.min_ps, st.seeds, st.offsets)
    masks = {} if mask is None else dict(bitmask=mask.words, bitmask_rows=mask.rows)
    return backend_for(logits.device).sample(
        *args, num_logprobs, logprobs=need_logprobs, plain=st.all_plain, min_p=st.any_min_p,
        top_k=st.any_top_k, **masks,
    )


class SlotSettings:
    """Sampling settings of up to `slots` rows in persistent device tensors, which CUDA graphs'
    captured samplers read (engine/cuda_graph.py). sampling_tensors(into=...) rewrites them
    when a step's sequences change; rows past its batch are greedy."""

    def __init__(self, slots: int, device: torch.device) -> None:
        self.values = torch.zeros(3, slots, dtype=torch.float32, device=device)  # temp, p, min-p
        self.values[1] = 1.0
        self.ints = torch.zeros(3, slots, dtype=torch.int64, device=device)  # top-k, seed, offset
        self.top_ks = torch.zeros(slots, dtype=torch.int32, device=device)

    @property
    def slots(self) -> int:
        return self.values.shape[1]

    def view(self, rows: int) -> SamplingTensors:
        """The first rows of the persistent settings, as the captured samplers read them."""
        v, i = self.values, self.ints
        return SamplingTensors(
            temperatures=v[0, :rows], top_ps=v[1, :rows], min_ps=v[2, :rows],
            top_ks=self.top_ks[:rows], seeds=i[1, :rows], offsets=i[2, :rows],
        )  # fmt: skip


def sampling_tensors(
    params: Sequence[SamplingParams],
    seeds: list[int],
    offsets: list[int],
    device: torch.device,
    into: SlotSettings | None = None,
    rows: Sequence[RowClass] | None = None,
) -> SamplingTensors:
    """One step's per-row settings, in two host-to-device copies (into: written to those
    persistent tensors, the returned ones their first rows); the kernel path's flags come
    from the rows' classes (rows; by default classify(params))."""
    n = len(params)
    if rows is None:
        rows = [classify(p) for p in params]
    pad = 0 if into is None else into.slots - n
    if pad < 0:
        raise ValueError(f"{n} rows of sampling settings do not fit {into.slots} slots")
    # values: [3, batch] = temperature, top_p, min_p; ints: [3, batch] = top_k, seed, offset
    values = pinned(torch.tensor(
        [[p.temperature for p in params] + [0.0] * pad,
         [p.top_p for p in params] + [1.0] * pad,
         [p.min_p for p in params] + [0.0] * pad],
        dtype=torch.float32,
    ))  # fmt: skip
    ints = pinned(torch.tensor(
        [[max(p.top_k, 0) for p in params] + [0] * pad, seeds + [0] * pad, offsets + [0] * pad],
        dtype=torch.int64,
    ))  # fmt: skip
    if into is None:
        values = values.to(device, non_blocking=True)
        ints = ints.to(device, non_blocking=True)
        top_ks = ints[0].to(torch.int32)
    else:
        into.values.copy_(values, non_blocking=True)
        into.ints.copy_(ints, non_blocking=True)
        into.top_ks.copy_(into.ints[0])
        values, ints, top_ks = into.values[:, :n], into.ints[:, :n], into.top_ks[:n]
    return SamplingTensors(
        temperatures=values[0],
        top_ps=values[1],
        min_ps=values[2],
        top_ks=top_ks,
        seeds=ints[1],
        offsets=ints[2],
        all_greedy=all(r.greedy for r in rows),
        all_plain=not any(r.top_k or r.top_p for r in rows),
        any_min_p=any(r.min_p for r in rows),
        any_top_k=any(r.top_k for r in rows),
    )
