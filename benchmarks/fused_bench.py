"""Fused elementwise kernels (rms_norm, qk_norm_rotary, silu_and_mul) against the torch ops
they replace, at Qwen3-0.6B's shapes (GPU only).

python benchmarks/fused_bench.py [--dtype bf16|fp16|fp32]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch

# Qwen3-0.6B
HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, INTERMEDIATE, NUM_LAYERS = 1024, 16, 8, 128, 3072, 28
MAX_POSITION, EPS = 40960, 1e-6
NUM_TOKENS = [256, 8192]  # a decode step at batch 256; a prefill chunk
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def bench_us(fn: Callable[[], object]) -> tuple[float, float | None]:
    """(eager median us incl. launch cost, CUDA-graph replay us or None if capture failed)."""
    import triton.testing

    eager = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    try:
        graph = triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3
    except Exception as e:  # a launcher that syncs cannot be captured: say so, keep going
        print(f"  graph capture failed: {type(e).__name__}: {str(e)[:80]}")
        graph = None
    return eager, graph


def cases(num_tokens: int, dtype: torch.dtype) -> list[tuple[str, Callable, Callable]]:
    """(name, torch path, fused path) for one layer's elementwise ops at num_tokens."""
    from nanopaged.kernels.rms_norm import rms_norm, rms_norm_ref
    from nanopaged.kernels.rotary import (
        apply_rotary,
        qk_norm_rotary,
        qk_norm_rotary_ref,
        rotary_ref,
    )
    from nanopaged.kernels.silu_and_mul import silu_and_mul
    from nanopaged.layers.rotary import RotaryEmbedding

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=dtype)

    x, residual, weight = randn(num_tokens, HIDDEN), randn(num_tokens, HIDDEN), randn(HIDDEN)
    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    qkv = randn(num_tokens, q_size + 2 * kv_size)
    # q, k: strided views of the qkv projection output, as the model hands them over
    q = qkv[:, :q_size].view(num_tokens, NUM_HEADS, HEAD_DIM)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    q_weight, k_weight = randn(HEAD_DIM), randn(HEAD_DIM)
    rope = RotaryEmbedding(HEAD_DIM, MAX_POSITION, 1_000_000.0).to("cuda")
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), device="cuda")
    gate_up = randn(num_tokens, 2 * INTERMEDIATE)
    qk_args = (q, k, q_weight, k_weight, EPS, rope.cos, rope.sin, positions)
    rope_args = (q, k, rope.cos, rope.sin, positions)

    def silu_torch() -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    return [
        ("add + rms_norm", lambda: rms_norm_ref(x, weight, EPS, residual),
         lambda: rms_norm(x, weight, EPS, residual)),
        ("rms_norm", lambda: rms_norm_ref(x, weight, EPS), lambda: rms_norm(x, weight, EPS)),
        ("q/k norm + rotary", lambda: qk_norm_rotary_ref(*qk_args),
         lambda: qk_norm_rotary(*qk_args)),
        ("rotary", lambda: rotary_ref(*rope_args), lambda: apply_rotary(*rope_args)),
        ("silu * up", silu_torch, lambda: silu_and_mul(gate_up)),
    ]


def fmt(us: float | None) -> str:
    return "   n/a" if us is None else f"{us:7.1f}"


def main(argv: list[str] | None = None) -> list[dict]:
    """Time every op both ways at decode and prefill sizes; print a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fused_bench needs a CUDA device")
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    rows = []
    for num_tokens in NUM_TOKENS:
        for name, torch_fn, fused_fn in cases(num_tokens, dtype):
            t_eager, t_graph = bench_us(torch_fn)
            f_eager, f_graph = bench_us(fused_fn)
            rows.append(dict(op=name, num_tokens=num_tokens, torch_eager=t_eager,
                             fused_eager=f_eager, torch_graph=t_graph, fused_graph=f_graph))
    print(f"\n{torch.cuda.get_device_name()}, {args.dtype}, times in us (median); "
          "eager includes launches, graph = CUDA-graph replay")
    print("| op | tokens | torch eager | fused eager | torch graph | fused graph | speedup |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        t, f = r["torch_graph"] or r["torch_eager"], r["fused_graph"] or r["fused_eager"]
        print(f"| {r['op']} | {r['num_tokens']} | {fmt(r['torch_eager'])} | "
              f"{fmt(r['fused_eager'])} | {fmt(r['torch_graph'])} | {fmt(r['fused_graph'])} | "
              f"{t / f:5.1f}x |")
    # Per layer: two add + rms_norm, one q/k norm + rotary, one silu * up.
    per_layer = {"add + rms_norm": 2, "q/k norm + rotary": 1, "silu * up": 1}
    for num_tokens in NUM_TOKENS:
        sel = [r for r in rows if r["num_tokens"] == num_tokens and r["op"] in per_layer]
        for key in ("torch", "fused"):
            total = sum(per_layer[r["op"]] * (r[f"{key}_graph"] or r[f"{key}_eager"]) for r in sel)
            print(f"{num_tokens} tokens, {key}: {NUM_LAYERS} layers x {total:.1f} us = "
                  f"{NUM_LAYERS * total / 1e3:.2f} ms per step")
    return rows


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    main()
