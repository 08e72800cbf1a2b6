"""Decode-sized GEMMs (1 to 16 rows, bf16): cuBLAS's F.linear against skinny_linear (GPU only).

python benchmarks/skinny_gemm_bench.py [--tune] [--pdl] [--json PATH] [--shapes qwen,llama]

Device time per call from CUDA graphs of many calls (decode replays graphs), each call reading
the next of several weight copies (together > 4x L2), so the weight comes from HBM as it does
in a decode step, where the other layers' weights evict it. TB/s = weight bytes / time.
--tune times every candidate launch of skinny_linear and reports the fastest per (shape, M);
--pdl also times it as a programmatic dependent launch (see pdl_experiment).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sampler_bench import graph_ms  # noqa: E402

from nanopaged.kernels.skinny_gemm import (  # noqa: E402
    SkinnyGemmConfig,
    default_config,
    k_split,
    skinny_linear,
    skinny_linear_ref,
)

# name -> (N, K) of weight [N, K]
SHAPES = {
    "qwen": {
        "qkv_proj": (4096, 1024),
        "o_proj": (1024, 2048),
        "gate_up_proj": (6144, 1024),
        "down_proj": (1024, 3072),
    },
    "llama": {
        "llama_qkv": (6144, 4096),
        "llama_o": (4096, 4096),
        "llama_gate_up": (28672, 4096),
        "llama_down": (4096, 14336),
    },
}
MS = (1, 2, 4, 8, 16)
ROTATE_BYTES = 256 << 20  # weight copies per graph: over 4x the H200's 60 MB L2
MIN_CALLS = 20
NUM_SMS = 132


def candidates(m: int, n: int, k: int) -> list[SkinnyGemmConfig]:
    """Launches --tune tries: narrow N tiles streaming K (elementwise FMA, M <= 8) and
    tensor-core tiles (M padded to 16), each with the K splits that give 1 to ~16 programs
    an SM."""
    block_m = 1 << (m - 1).bit_length()
    tiles: list[tuple[int, int, bool, int, int]] = []  # (block_n, block_k, dot, warps, stages)
    if m <= 8:
        for block_n in (1, 2, 4, 8):
            if block_n * block_m > 32:  # registers: x and the accumulators grow with both
                continue
            # BLOCK_K = 256 * warps puts every warp along K (one layout for w and x); twice
            # that gives each thread two 16-byte loads a row.
            for block_k, warps in ((512, 2), (1024, 4), (2048, 8), (1024, 2), (2048, 4)):
                if block_k <= k and (block_k == 256 * warps or block_n * block_m <= 8):
                    tiles.append((block_n, block_k, False, warps, 1))
    if m >= 4:
        for block_n, block_k, warps in ((32, 128, 4), (32, 256, 4), (64, 64, 4), (64, 128, 4),
                                        (64, 256, 4), (128, 64, 4), (128, 128, 8)):
            for stages in (4, 6):
                tiles.append((block_n, block_k, True, warps, stages))
    out = []
    for block_n, block_k, dot, warps, stages in tiles:
        num_tiles = -(-n // block_n)
        seen = set()
        for split in (1, 2, 3, 4, 6, 8, 16):
            real = k_split(k, split, block_k)[1]
            too_many = real > 1 and num_tiles * real > 16 * NUM_SMS
            if real in seen or too_many or (real > 1 and num_tiles * real < NUM_SMS // 2):
                continue
            seen.add(real)
            out.append(SkinnyGemmConfig(block_n, block_k, real, dot, warps, stages))
    return out


def weight_copies(n: int, k: int) -> list[torch.Tensor]:
    """Random bf16 weights [n, k], scaled so outputs are O(1), enough to cover ROTATE_BYTES."""
    count = max(2, math.ceil(ROTATE_BYTES / (n * k * 2)))
    return [(torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16) for _ in range(count)]


def graph_us(call, weights: list[torch.Tensor], replays: int = 7) -> float:
    """Microseconds per call of call(weight), from a graph of calls over the weight copies in
    turn (median of replays)."""
    for w in weights[:2]:
        call(w)  # compiles and warms up outside the capture
    turn = itertools.cycle(weights)  # each captured call takes the next copy
    ms = graph_ms(lambda: call(next(turn)), calls=max(MIN_CALLS, len(weights)), replays=replays)
    assert ms is not None, "the call could not be captured in a CUDA graph"
    return 1000 * ms


def max_rel_err(x: torch.Tensor, w: torch.Tensor, cfg: SkinnyGemmConfig) -> float:
    """max |out - ref| / max |ref| of one launch."""
    out, ref = skinny_linear(x, w, config=cfg).float(), skinny_linear_ref(x, w).float()
    return ((out - ref).abs().max() / ref.abs().max()).item()


def _compile_worker(jobs: list[tuple[int, int, int, SkinnyGemmConfig]]) -> int:
    """Compile each launch once (Triton's disk cache then serves the parent process)."""
    failed = 0
    for m, n, k, cfg in jobs:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        try:
            skinny_linear(x, w, config=cfg)
        except Exception:  # out of shared memory, say: the parent's timing skips it too
            failed += 1
    torch.cuda.synchronize()
    return failed


def precompile(jobs: list[tuple[int, int, int, SkinnyGemmConfig]], workers: int) -> None:
    """Compile the distinct kernels among jobs in parallel processes."""
    if workers <= 1:
        return
    distinct = {}
    for m, n, k, cfg in jobs:
        # What the kernel is specialized on: its constexprs, and M == 1, M % 16 == 0.
        k_per_split = k_split(k, cfg.split_k, cfg.block_k)[0]
        key = (1 << (m - 1).bit_length(), m == 1, m % 16 == 0, cfg.block_n, cfg.block_k,
               cfg.split_k > 1, k % k_per_split == 0, cfg.use_dot, cfg.num_warps,
               cfg.num_stages)
        distinct.setdefault(key, (m, n, k, cfg))
    todo = list(distinct.values())
    print(f"compiling {len(todo)} kernels in {workers} processes", flush=True)
    ctx = torch.multiprocessing.get_context("spawn")
    with ctx.Pool(workers) as pool:
        failed = sum(pool.map(_compile_worker, [todo[i::workers] for i in range(workers)]))
    print(f"  {failed} failed to compile", flush=True)


def copy_tbps() -> float:
    """Copy bandwidth through a kernel (a graph's memcpy node may use the copy engines), bytes
    read plus written: a ceiling for streaming."""
    a = torch.randn(1 << 29, device="cuda").to(torch.bfloat16)
    b = torch.empty_like(a)
    us = graph_us(lambda w: torch.neg(w, out=b), [a])
    return 2 * a.numel() * 2 / us / 1e6


def floor_us() -> float:
    """A graph's cost per call of a one-program kernel: the part of any call's time that no
    kernel design removes."""
    a = torch.zeros(16, device="cuda")
    return graph_us(lambda w: torch.neg(w, out=a), [a, a.clone()], replays=20)


def pdl_experiment(x: torch.Tensor, weights: list[torch.Tensor], cfg: SkinnyGemmConfig) -> dict:
    """skinny_linear launched as a programmatic dependent: back to back (each GEMM lets the
    next start early), and after a kernel that writes x and knows nothing of PDL (as in a
    decode step: norm -> qkv_proj), where each GEMM's time is the pair's less the producer's."""
    src = x.clone()
    back_to_back = graph_us(lambda w: skinny_linear(x, w, config=cfg, pdl=True), weights)
    producer = graph_us(lambda w: torch.mul(src, 1.0, out=x), weights)
    after = {
        "cublas": lambda w: F.linear(x, w),
        "skinny": lambda w: skinny_linear(x, w, config=cfg),
        "pdl": lambda w: skinny_linear(x, w, config=cfg, pdl=True),
    }
    out = dict(pdl_us=back_to_back, producer_us=producer)
    for key, gemm in after.items():
        pair = graph_us(lambda w, gemm=gemm: (torch.mul(src, 1.0, out=x), gemm(w)), weights)
        out[f"after_producer_{key}_us"] = pair - producer
    return out


def bench_shape(name: str, n: int, k: int, tune: bool, pdl: bool) -> list[dict]:
    """Rows for one weight shape at every M."""
    weights = weight_copies(n, k)
    wbytes = n * k * 2
    rows = []
    for m in MS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cfg = default_config(m, n, k)
        # Each timed three times, alternating, median: runs of one launch differ by ~5%.
        cublas_runs, ours_runs = [], []
        for _ in range(3):
            cublas_runs.append(graph_us(lambda w, x=x: F.linear(x, w), weights))
            ours_runs.append(
                graph_us(lambda w, x=x, cfg=cfg: skinny_linear(x, w, config=cfg), weights))
        cublas, ours = statistics.median(cublas_runs), statistics.median(ours_runs)
        row = dict(shape=name, n=n, k=k, m=m, weight_bytes=wbytes, cublas_us=cublas,
                   cublas_tbps=wbytes / cublas / 1e6, skinny_us=ours,
                   skinny_tbps=wbytes / ours / 1e6, ratio=cublas / ours,
                   config=cfg.__dict__, rel_err=max_rel_err(x, weights[0], cfg))
        if pdl:
            try:
                row.update(pdl_experiment(x, weights, cfg))
            except Exception as e:  # an older Triton, or a capture that refuses PDL edges
                print(f"  pdl failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                pdl = False
        if tune:
            tried = []
            for c in candidates(m, n, k):
                try:
                    us = graph_us(lambda w, x=x, c=c: skinny_linear(x, w, config=c), weights,
                                  replays=5)
                except Exception as e:  # a launch that does not fit (shared memory)
                    print(f"  skip {c}: {type(e).__name__}", flush=True)
                    continue
                tried.append(dict(config=c.__dict__, us=us))
            best = min(tried, key=lambda t: t["us"])
            best_cfg = SkinnyGemmConfig(**best["config"])
            row.update(tuned=sorted(tried, key=lambda t: t["us"]), best_us=best["us"],
                       best_config=best["config"], best_ratio=cublas / best["us"],
                       best_rel_err=max_rel_err(x, weights[0], best_cfg))
        rows.append(row)
        print(f"  {name} M={m}: cuBLAS {cublas:.2f} us, skinny {ours:.2f} us"
              + (f", tuned {row['best_us']:.2f} us {row['best_config']}" if tune else ""),
              flush=True)
    del weights
    torch.cuda.empty_cache()
    return rows


def cfg_str(c: dict) -> str:
    kind = "dot" if c["use_dot"] else "fma"
    return (f"{kind} n{c['block_n']} k{c['block_k']} s{c['split_k']} "
            f"w{c['num_warps']}" + (f" st{c['num_stages']}" if c["use_dot"] else ""))


def print_table(rows: list[dict], tune: bool) -> None:
    head = "| shape | N x K | M | cuBLAS us | TB/s | skinny us | TB/s | speedup |"
    line = "|---|---|---:|---:|---:|---:|---:|---:|"
    if tune:
        head += " tuned us | TB/s | speedup | tuned config |"
        line += "---:|---:|---:|---|"
    print(head)
    print(line)
    for r in rows:
        s = (f"| {r['shape']} | {r['n']}x{r['k']} | {r['m']} | {r['cublas_us']:.2f} | "
             f"{r['cublas_tbps']:.2f} | {r['skinny_us']:.2f} | {r['skinny_tbps']:.2f} | "
             f"{r['ratio']:.2f}x |")
        if tune:
            s += (f" {r['best_us']:.2f} | {r['weight_bytes'] / r['best_us'] / 1e6:.2f} | "
                  f"{r['best_ratio']:.2f}x | {cfg_str(r['best_config'])} |")
        print(s)


def main(argv: list[str] | None = None) -> list[dict]:
    """Time every (shape, M) both ways; print a markdown table, optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tune", action="store_true", help="sweep skinny_linear's launches")
    parser.add_argument("--json", type=Path, help="write all rows here")
    parser.add_argument("--pdl", action="store_true",
                        help="also time skinny_linear as a programmatic dependent launch")
    parser.add_argument("--shapes", default="qwen,llama", help="comma list of: qwen, llama")
    parser.add_argument("--jobs", type=int, default=min(8, (os.cpu_count() or 2) // 2),
                        help="processes compiling --tune's kernels")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("skinny_gemm_bench needs a CUDA device")
    torch.manual_seed(0)
    shapes = {name: nk for group in args.shapes.split(",") for name, nk in SHAPES[group].items()}
    if args.tune:
        precompile([(m, n, k, c) for n, k in shapes.values() for m in MS
                    for c in candidates(m, n, k) + [default_config(m, n, k)]], args.jobs)
    ceiling, floor = copy_tbps(), floor_us()
    print(f"{torch.cuda.get_device_name()}: copy {ceiling:.2f} TB/s, a 16-element kernel "
          f"{floor:.2f} us per call", flush=True)
    rows = []
    for name, (n, k) in shapes.items():
        rows += bench_shape(name, n, k, args.tune, args.pdl)
        if args.json:  # after every shape, so a run cut short still leaves its rows
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(),
                                                 copy_tbps=ceiling, floor_us=floor,
                                                 rows=rows), indent=1))
    print(f"\n{torch.cuda.get_device_name()}, bf16, us per call (CUDA-graph replay, weights "
          f"rotating past L2), TB/s = weight bytes / time; copy ceiling {ceiling:.2f} TB/s, "
          f"a 16-element kernel {floor:.2f} us")
    print_table(rows, args.tune)
    if args.pdl:
        print("\nProgrammatic dependent launch (default launches): back to back, and after a "
              "producer kernel that writes x (GEMM us = pair - producer alone)")
        print("| shape | M | skinny | skinny pdl | after producer: cuBLAS | skinny | "
              "skinny pdl |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in (r for r in rows if "pdl_us" in r):
            print(f"| {r['shape']} | {r['m']} | {r['skinny_us']:.2f} | {r['pdl_us']:.2f} | "
                  f"{r['after_producer_cublas_us']:.2f} | {r['after_producer_skinny_us']:.2f} | "
                  f"{r['after_producer_pdl_us']:.2f} |")
    return rows


if __name__ == "__main__":
    main()
