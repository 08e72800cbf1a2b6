"""Quantized GEMMs on Qwen3-8B's projection shapes against their bandwidth bound (GPU only):
W4A16 (AWQ repacked as at load, GPTQ, GPTQ desc_act) and W8A8 FP8 (128x128 blocks; per
channel through the Triton kernel and through torch._scaled_mm), with bf16 cuBLAS (F.linear)
beside them, at 1, 4, 8, 16 and 256 rows (W4A16 up to M_GEMV rows runs its GEMV kernel, above
it the tensor-core one).

python benchmarks/quant_gemm_bench.py [--rows 1 4 8 16 256] [--kinds ...] [--shapes ...] [--tune]
    [--json PATH]

Device time per call from CUDA graphs of many calls, each reading the next of several weight
copies (together > 4x L2), as a decode step reads weights from HBM. A quantized layer's call
includes what it runs per call: the FP8 layers quantize the activations first. The bound is
the call's bytes (weight, scales, activations in and out) at the copy rate measured in the
same run; "of bound" = bound / time. --tune also times candidate launches of the Triton
kernels and prints the fastest per (shape, rows) as TUNED entries of the kernel's module (the
default_config reads them; DEFAULT_TILES holds the fallback per row count).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from skinny_gemm_bench import ROTATE_BYTES, copy_tbps, graph_us  # noqa: E402

from nanopaged.kernels import fp8_gemm, w4a16_gemm  # noqa: E402
from nanopaged.kernels.w4a16_gemm import Int4Weight, W4A16Config  # noqa: E402
from nanopaged.quantization.awq import repack_awq  # noqa: E402

# weight [N, K] of Qwen3-8B's projections
SHAPES = {
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (24576, 4096),
    "down_proj": (4096, 12288),
}
GROUP = 128
BLOCK = (128, 128)
KINDS = ("bf16", "awq", "gptq", "gptq-desc_act", "fp8-block", "fp8-channel",
         "fp8-channel-scaled_mm")  # fmt: skip
INT4_KINDS = ("awq", "gptq", "gptq-desc_act")


def _int32(shape) -> torch.Tensor:
    return torch.randint(-(1 << 31), (1 << 31) - 1, shape, dtype=torch.int32, device="cuda")


def make_weight(kind: str, n: int, k: int):
    """One random weight of this kind: a tensor, an Int4Weight or (fp8 weight, scale)."""
    if kind == "bf16":
        return (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    groups = k // GROUP
    scales = (torch.rand(groups, n, device="cuda") * 2e-3).half()
    if kind == "awq":  # AWQ's tensors, repacked as the AWQ layer does after loading
        qweight, qzeros = repack_awq(_int32((k, n // 8)), _int32((groups, n // 8)))
        return Int4Weight(qweight, scales, qzeros, GROUP)
    if kind.startswith("gptq"):
        g_idx = None
        if kind == "gptq-desc_act":
            g_idx = torch.empty(k, dtype=torch.int32, device="cuda")
            g_idx[torch.randperm(k, device="cuda")] = (
                torch.arange(k, device="cuda") // GROUP).int()  # fmt: skip
        return Int4Weight(_int32((k // 8, n)), scales, None, GROUP, g_idx, 1)
    w = torch.randn(n, k, device="cuda").mul(50).clamp(-448, 448).to(fp8_gemm.FP8)
    if kind == "fp8-block":
        return w, torch.rand(n // BLOCK[0], k // BLOCK[1], device="cuda") * 1e-3
    return w, torch.rand(n, 1, device="cuda") * 1e-3


def weight_bytes(weight) -> int:
    tensors = [weight] if isinstance(weight, torch.Tensor) else (
        [weight.qweight, weight.scales, weight.qzeros, weight.g_idx]
        if isinstance(weight, Int4Weight) else list(weight))  # fmt: skip
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def make_call(kind: str, x: torch.Tensor, config=None):
    """call(weight) -> output, as the layer computes it (FP8: activation quantization too)."""
    if kind == "bf16":
        return lambda w: F.linear(x, w)
    if kind in INT4_KINDS:
        return lambda w: w4a16_gemm.w4a16_gemm(x, w, config)
    if kind == "fp8-channel-scaled_mm":

        def scaled_mm(w):
            xq, xs = fp8_gemm.per_token_group_quant(x, x.shape[1])
            return torch._scaled_mm(xq, w[0].t(), scale_a=xs, scale_b=w[1].view(1, -1),
                                    out_dtype=torch.bfloat16)  # fmt: skip

        return scaled_mm
    block = BLOCK if kind == "fp8-block" else (1, x.shape[1])

    def block_gemm(w):
        xq, xs = fp8_gemm.per_token_group_quant(x, block[1])
        return fp8_gemm.w8a8_block_gemm(xq, xs, w[0], w[1], block, x.dtype, config)

    return block_gemm


def make_copies(kind: str, n: int, k: int) -> list:
    """Enough weights of this kind that cycling through them reads HBM, not L2."""
    first = make_weight(kind, n, k)
    return [first] + [make_weight(kind, n, k) for _ in range(ROTATE_BYTES // weight_bytes(first))]


def time_kind(kind: str, copies: list, n: int, k: int, m: int, bw: float, config=None) -> dict:
    """One (kind, rows, launch) timing over the weight copies of an [n, k] weight."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    us = graph_us(make_call(kind, x, config), copies)
    total = weight_bytes(copies[0]) + 2 * m * (k + n)  # bf16 activations in, output out
    bound_us = total / (bw * 1e6)
    config = None if config is None else config.__dict__
    return dict(kind=kind, n=n, k=k, m=m, us=us, bytes=total, bound_us=bound_us,
                of_bound=bound_us / us, config=config)  # fmt: skip


def candidates(kind: str, m: int) -> list:
    """Launches --tune tries for the Triton kernels: decode tiles of 16 rows with K splits,
    wider tiles as rows grow (the launcher's own split is the default's row, timed apart: a
    candidate names its split, as the kernels' checks want); up to M_GEMV rows the
    W4A16 GEMV kernel too (one row tile; K splits summed by the last split or by a second
    launch), so the table may pick either kernel per shape."""
    if m <= 16:
        grid = ((16,), (16, 32, 64, 128), (64, 128), (1, 2, 4, 8, 16), (4,), (3, 4))
    elif m <= 64:
        grid = ((32, 64), (64, 128), (64, 128), (1, 2), (4, 8), (3, 4))
    else:
        grid = ((64, 128), (128, 256), (64, 128), (1,), (4, 8), (3, 4))
    if kind not in INT4_KINDS:
        return [fp8_gemm.Fp8GemmConfig(*launch) for launch in itertools.product(*grid)]
    found = [W4A16Config(*launch) for launch in itertools.product(*grid)]
    if m <= w4a16_gemm.M_GEMV:
        rows = next(r for r, _ in w4a16_gemm.DEFAULT_TILES if m <= r)
        gemv = ((rows,), (256, 512), (32, 64, 128), (4, 8, 16, 32), (4, 8), (2,))
        for launch in itertools.product(*gemv):
            found.append(W4A16Config(*launch, gemv=True))
            if launch[3] == 16:  # the splits summed by sum_splits instead
                found.append(W4A16Config(*launch, gemv=True, fused_sum=False))
    return found


def kernel_module(kind: str):
    return w4a16_gemm if kind in INT4_KINDS else fp8_gemm


def tuned_line(kind: str, m: int, n: int, k: int, config: dict) -> str:
    """The TUNED entry of the kernel's module for this launch, ready to paste."""
    mod = kernel_module(kind)
    bucket = next(rows for rows, _ in mod.DEFAULT_TILES if m <= rows)
    cls = type(mod.DEFAULT_TILES[0][1]).__name__
    args = ", ".join(f"{key}={value}" for key, value in config.items())
    name = mod.__name__.rsplit(".", 1)[-1]
    bucket = "1 << 62" if bucket == 1 << 62 else bucket  # the table's "any more rows"
    return f"{name}.TUNED[({bucket}, {n}, {k})] = {cls}({args})  # {kind}"


def tune(kind: str, copies: list, m: int, bw: float, row: dict) -> dict:
    """The fastest candidate launch (the default's timing included) of one kind and shape."""
    best = row
    for cfg in candidates(kind, m):
        try:
            tried = time_kind(kind, copies, row["n"], row["k"], m, bw, cfg)
        except Exception:  # out of shared memory, a block_k past the group, ...
            continue
        best = tried if tried["us"] < best["us"] else best
    if best["config"] is None:  # the default won: name its launch
        n, k = row["n"], row["k"]
        group = GROUP if kind in INT4_KINDS else (
            BLOCK[1] if kind == "fp8-block" else k)  # fmt: skip
        best = dict(best, config=kernel_module(kind).default_config(m, n, k, group).__dict__)
    return best


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 256])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--tune", action="store_true", help="time candidate Triton launches")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the quantized GEMM benchmark needs CUDA")
    bw = copy_tbps()
    print(f"{torch.cuda.get_device_name()}: copy {bw:.2f} TB/s", flush=True)
    rows, tuned = [], []
    shapes = {name: SHAPES[name] for name in args.shapes}
    for (name, (n, k)), m in itertools.product(shapes.items(), args.rows):
        base = None
        for kind in args.kinds:
            copies = make_copies(kind, n, k)
            try:
                row = time_kind(kind, copies, n, k, m, bw)
            except RuntimeError as e:  # torch._scaled_mm on a GPU without FP8, say
                print(f"{name} m={m} {kind}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            if args.tune and kind not in ("bf16", "fp8-channel-scaled_mm"):
                best = tune(kind, copies, m, bw, row)
                row["best_us"], row["best_config"] = best["us"], best["config"]
                tuned.append(tuned_line(kind, m, n, k, best["config"]))
            del copies
            base = row["us"] if kind == "bf16" else base
            row.update(shape=name, speedup_vs_bf16=None if base is None else base / row["us"])
            rows.append(row)
            best = f", tuned {row['best_us']:.1f} us {row['best_config']}" if args.tune \
                and "best_us" in row else ""  # fmt: skip
            vs = f", {row['speedup_vs_bf16']:.2f}x bf16" if base is not None else ""
            print(f"{name:13s} m={m:4d} {kind:22s} {row['us']:8.1f} us, "
                  f"{100 * row['of_bound']:5.1f}% of bound{vs}{best}", flush=True)  # fmt: skip
    if tuned:
        print("\n# fastest launches, as TUNED entries of the kernels' modules:")
        print("\n".join(tuned))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
