"""Presence, frequency and repetition penalties applied in place to rows of fp32 logits, from
per-sequence token counts kept on the device (sampling/penalties.py), in one pass.

vLLM's arithmetic, per token t of a row (rep, freq, pres: the row's penalties; c: t's count in
the output; seen: t in the prompt or the output):
    x = x / rep if x > 0 else x * rep        (when seen)
    x = x - freq * c
    x = x - pres * (c > 0)
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use penalize_rows_ref
    triton = None


def apply_penalties(
    logits: torch.Tensor,
    seen: torch.Tensor,
    output_counts: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties: repetition (prompt + output tokens), then frequency and presence
    (output tokens only).

    logits: [batch, vocab]; seen: [batch, vocab] bool, in the prompt or the output;
    output_counts: [batch, vocab], occurrences in the output; presence, frequency, repetition:
    [batch]. A seen token's logit is divided by repetition when positive, multiplied when not.
    """
    rep = repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    counts = output_counts.to(logits.dtype)
    logits = logits - frequency[:, None] * counts
    return logits - presence[:, None] * (counts > 0).to(logits.dtype)


def penalize_rows_ref(
    logits: torch.Tensor,
    rows: torch.Tensor,
    state_rows: torch.Tensor,
    counts: torch.Tensor,
    prompt: torch.Tensor,
    penalties: torch.Tensor,
) -> None:
    """In place: row rows[i] of logits [batch, vocab] fp32 takes the penalties of counts
    [states, vocab] int32 and prompt [states, vocab] bool at state_rows[i], with penalties
    [3, n] fp32 = presence, frequency, repetition of each of the n rows."""
    c = counts.index_select(0, state_rows)
    seen = prompt.index_select(0, state_rows) | (c > 0)
    picked = logits.index_select(0, rows)
    logits[rows] = apply_penalties(picked, seen, c, penalties[0], penalties[1], penalties[2])


if triton is not None:

    @triton.jit
    def _penalize_kernel(
        logits_ptr, rows_ptr, state_rows_ptr, counts_ptr, prompt_ptr, penalties_ptr,
        num_rows, vocab, stride_logits,
        BLOCK: tl.constexpr,
    ):
        # Grid: (n, cdiv(vocab, BLOCK)): BLOCK tokens of one penalized row.
        i = tl.program_id(0)
        row = tl.load(rows_ptr + i).to(tl.int64)  # offsets past 2^31 in large count tables
        state = tl.load(state_rows_ptr + i).to(tl.int64)
        presence = tl.load(penalties_ptr + i)
        frequency = tl.load(penalties_ptr + num_rows + i)
        repetition = tl.load(penalties_ptr + 2 * num_rows + i)
        idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < vocab
        ptrs = logits_ptr + row * stride_logits + idx
        x = tl.load(ptrs, mask=mask, other=0.0)
        c = tl.load(counts_ptr + state * vocab + idx, mask=mask, other=0)
        seen = (tl.load(prompt_ptr + state * vocab + idx, mask=mask, other=0) != 0) | (c > 0)
        x = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition), x)
        cf = c.to(tl.float32)
        x = x - frequency * cf
        x = x - presence * (c > 0).to(tl.float32)
        tl.store(ptrs, x, mask=mask)


def penalize_rows(
    logits: torch.Tensor,
    rows: torch.Tensor,
    state_rows: torch.Tensor,
    counts: torch.Tensor,
    prompt: torch.Tensor,
    penalties: torch.Tensor,
    block: int = 2048,
) -> None:
    """penalize_rows_ref in one Triton pass over the penalized rows (reads each logit, count
    and prompt flag once, writes the logit back)."""
    assert triton is not None, "penalize_rows needs triton; use penalize_rows_ref"
    assert logits.dtype == torch.float32 and logits.stride(1) == 1, (logits.dtype, logits.stride())
    n, vocab = rows.numel(), logits.shape[1]
    assert counts.shape[1] == vocab and prompt.shape[1] == vocab and counts.is_contiguous()
    assert prompt.dtype == torch.bool and prompt.is_contiguous() and counts.dtype == torch.int32
    assert penalties.shape == (3, n) and penalties.dtype == torch.float32, penalties.shape
    assert rows.dtype == state_rows.dtype == torch.int64 and state_rows.numel() == n
    if n == 0:
        return
    _penalize_kernel[(n, triton.cdiv(vocab, block))](
        logits, rows, state_rows, counts, prompt.view(torch.int8), penalties.contiguous(),
        n, vocab, logits.stride(0), BLOCK=block, num_warps=4,
    )  # fmt: skip
