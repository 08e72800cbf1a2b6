"""Penalized decode steps: counts kept on the device and the fused penalty kernel, against
torch arithmetic and counts rebuilt from token lists.

python benchmarks/penalty_bench.py [--batch 256] [--vocab 151936] [--device cuda]

B sequences (300 prompt tokens each, frequency, presence and repetition penalties) decode
asynchronously: every step each has a token pending on the device. Per output length, the
wall time of one step's `penalize` (host work and device time, synchronized): with the
runner's PenaltyCounts carried from step to step and the backend's penalty op (the Triton
kernel on CUDA); the same counts with the torch reference's arithmetic; and counts built
from each sequence's token lists with the torch arithmetic (every penalized step before).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from nanopaged.engine.sequence import Sequence
from nanopaged.kernels.penalties import penalize_rows_ref
from nanopaged.layers.backend import backend_for
from nanopaged.sampling import penalties as sampling
from nanopaged.sampling.penalties import PenaltyCounts, penalize
from nanopaged.sampling_params import SamplingParams

PARAMS = SamplingParams(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2)


def step_ms(logits, seqs, pending, counts, device, steps: int) -> float:
    """Mean ms of penalize over `steps` steps, each appending the last pending token."""
    total = 0.0
    for _ in range(steps):
        for s in seqs:  # the previous step's samples reach the host; new ones are pending
            s.token_ids.append(int(pending[s.pending_row]))
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        penalize(logits, seqs, pending, counts)
        if device.type == "cuda":
            torch.cuda.synchronize()
        total += time.perf_counter() - start
    return 1000 * total / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.batch, args.vocab, generator=gen).to(device)
    pending = torch.randint(0, args.vocab, (args.batch,), generator=gen).to(device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}, batch {args.batch}, vocab {args.vocab}")
    print(f"{'outputs':>8} {'kept ms':>9} {'kept, torch':>12} {'rebuilt, torch':>15} "
          f"{'ratio':>7}")  # fmt: skip
    torch_ops = dataclasses.replace(backend_for(device), penalize_rows=penalize_rows_ref)
    for length in (100, 500, 1000):
        seqs = []
        for _ in range(args.batch):
            prompt = torch.randint(0, args.vocab, (300,), generator=gen).tolist()
            seq = Sequence(prompt, PARAMS)
            seq.token_ids += torch.randint(0, args.vocab, (length,), generator=gen).tolist()
            seqs.append(seq)
        for row, seq in enumerate(seqs):
            seq.pending_row = row
        counts = PenaltyCounts(args.vocab, device)
        penalize(logits, seqs, pending, counts)  # first sight: rows built once
        kept = step_ms(logits, seqs, pending, counts, device, args.steps)
        sampling.backend_for = lambda _device: torch_ops
        try:
            kept_torch = step_ms(logits, seqs, pending, counts, device, args.steps)
            rebuilt = step_ms(logits, seqs, pending, None, device, args.steps)
        finally:
            sampling.backend_for = backend_for
        print(f"{length:>8} {kept:9.2f} {kept_torch:12.2f} {rebuilt:15.2f} "
              f"{rebuilt / kept:6.1f}x", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
