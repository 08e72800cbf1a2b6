"""penalize_rows (Triton) against penalize_rows_ref: penalties from counts kept on the device."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import DEVICE

from nanopaged.kernels.penalties import penalize_rows, penalize_rows_ref


def _inputs(batch: int, vocab: int, seed: int, width: int | None = None):
    gen = torch.Generator().manual_seed(seed)
    # Rows of a wider buffer (strided), with positive, negative and zero logits.
    buf = torch.randn(batch, width or vocab, generator=gen) * 3
    buf[:, ::11] = 0.0
    states = batch + 3
    counts = torch.randint(0, 4, (states, vocab), generator=gen, dtype=torch.int32)
    counts[torch.rand(states, vocab, generator=gen) < 0.7] = 0
    prompt = torch.rand(states, vocab, generator=gen) < 0.1
    # A subset of the rows, in no order, each with its own state row and penalties: presence
    # and frequency of both signs, repetition below, at and above 1.
    rows = torch.randperm(batch, generator=gen)[: batch - 2]
    state_rows = torch.randperm(states, generator=gen)[: len(rows)]
    n = len(rows)
    penalties = torch.stack([
        torch.randn(n, generator=gen),
        torch.randn(n, generator=gen),
        torch.rand(n, generator=gen) * 1.5 + 0.5,
    ])  # fmt: skip
    penalties[2, 0] = 1.0
    buf = buf.to(DEVICE)
    logits = buf[:, :vocab]  # a view of the buffer on the device too
    on = lambda t: t.to(DEVICE)  # noqa: E731
    return (buf, logits), on(rows), on(state_rows), on(counts), on(prompt), on(penalties)


@pytest.mark.parametrize("vocab,block,width", [(1000, 256, None), (300, 128, 320), (64, 64, None)])
def test_penalize_rows_equals_ref(vocab, block, width):
    (buf, logits), rows, state_rows, counts, prompt, penalties = _inputs(9, vocab, vocab, width)
    want_buf = buf.clone()
    want = want_buf[:, :vocab]
    penalize_rows_ref(want, rows, state_rows, counts, prompt, penalties)
    before = buf.clone()
    penalize_rows(logits, rows, state_rows, counts, prompt, penalties, block=block)
    # Under the interpreter the kernel's fp32 arithmetic is the reference's, bit for bit; a GPU
    # may contract a product and a difference into one rounding.
    tol = dict(rtol=0, atol=0) if DEVICE == "cpu" else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(buf, want_buf, **tol)
    untouched = torch.ones(buf.shape[0], dtype=torch.bool, device=buf.device)
    untouched[rows] = False
    assert torch.equal(buf[untouched], before[untouched])  # other rows and the padding
    assert torch.equal(buf[:, vocab:], before[:, vocab:])
    assert not torch.equal(buf[rows], before[rows])  # the penalties did change the rows


def test_penalize_rows_rejects_other_dtypes():
    (_, logits), rows, state_rows, counts, prompt, penalties = _inputs(4, 64, 1)
    with pytest.raises(AssertionError):
        penalize_rows(logits.half(), rows, state_rows, counts, prompt, penalties)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_penalize_rows_large_vocab():
    (buf, logits), rows, state_rows, counts, prompt, penalties = _inputs(40, 151_936, 7)
    want = buf.clone()
    penalize_rows_ref(want, rows, state_rows, counts, prompt, penalties)
    penalize_rows(logits, rows, state_rows, counts, prompt, penalties)
    torch.testing.assert_close(buf, want, rtol=1e-6, atol=1e-6)
