"""Per-step decode latency at small batches, beside the HBM bound of one step.

python benchmarks/latency_bench.py [--model PATH] [--batch 1 8] [--context 300] [--profile]
                                   (or python bench.py --latency)
python benchmarks/latency_bench.py --model-shape qwen3-8b --quantization fp8 awq gptq
    dummy weights of a published shape, in bf16 and then each quantized format, one process

For each batch size B: B random 300-token prompts generated twice through `LLM.generate`,
once for 1 token and once for 1 + STEPS tokens (`ignore_eos`); the difference divided by
STEPS is one decode step as a user meets it (scheduling, the CUDA graph, sampling, output
processing, asynchronous overlap included). The bound is one step's weight and KV bytes at
the copy rate measured in the same run. `--profile` adds, per batch size, the GPU time of one
step summed over its kernels (torch profiler), so the gap between wall time and GPU time is
the host's share.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STEPS = 256
SETTINGS = {
    "greedy": dict(temperature=0),
    "t0.8 top_p0.95 seed": dict(temperature=0.8, top_p=0.95, seed=0),
}


def step_bound_bytes(llm, batch: int, context: int) -> float:
    """HBM bytes one decode step must read: every weight once, every sequence's KV."""
    c = llm.model_config
    elem = torch.empty((), dtype=llm.kv_cache_dtype).element_size()
    weights = sum(p.numel() * p.element_size() for p in llm.runner.model.parameters())
    kv_per_token = 2 * c.num_layers * llm.runner.num_kv_heads * c.head_dim * elem
    return weights + batch * (context + STEPS // 2) * kv_per_token


def _timed_generate(llm, prompts, params) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def gpu_ms_per_step(llm, prompts, params, top: int = 0) -> float:
    """Sum of CUDA kernel time over a STEPS-token generate, per decode step; prints the
    `top` kernels by time, per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    for e in events[:top]:
        print(f"    {e.self_device_time_total / STEPS:8.1f} us/step {e.count / STEPS:6.1f} "
              f"calls/step  {e.key[:90]}")  # fmt: skip
    return sum(e.self_device_time_total for e in events) / 1000 / STEPS


def run_latency(model_dir: Path, batches: list[int], context: int, profile: bool,
                enforce_eager: bool = False, load_format: str = "auto",
                speculative_config: dict | None = None) -> dict:  # fmt: skip
    import bench
    from nanopaged import LLM, SamplingParams
    from nanopaged.quantization import weight_bytes

    llm = LLM(str(model_dir), max_model_len=4096, enforce_eager=enforce_eager,
              load_format=load_format, speculative_config=speculative_config)  # fmt: skip
    bw = bench.copy_bandwidth_tbps()
    rng = random.Random(0)
    quant = llm.model_config.quantization
    result = {"device": torch.cuda.get_device_name(), "copy_tb_per_s": bw, "context": context,
              "steps": STEPS, "model": str(model_dir), "load_format": load_format,
              "quantization": quant.name if quant else None,
              "weight_bytes": weight_bytes(llm.runner.model), "rows": []}  # fmt: skip
    print(f"{model_dir.name}: {result['weight_bytes'] / 2**30:.2f} GiB of weights", flush=True)
    for batch in batches:
        bound_ms = step_bound_bytes(llm, batch, context) / (bw * 1e12) * 1e3
        for name, setting in SETTINGS.items():
            # Fresh prompts per measurement: the prefix cache never serves an earlier one.
            def prompts(batch: int = batch) -> list[list[int]]:
                return [[rng.randrange(0, 100000) for _ in range(context)] for _ in range(batch)]

            one = SamplingParams(ignore_eos=True, max_tokens=1, **setting)
            many = SamplingParams(ignore_eos=True, max_tokens=1 + STEPS, **setting)
            _timed_generate(llm, prompts(), many)  # warm-up: graphs, Triton variants
            t1 = min(_timed_generate(llm, prompts(), one) for _ in range(3))
            spec0 = llm.spec_stats()
            tn = min(_timed_generate(llm, prompts(), many) for _ in range(3))
            spec = llm.spec_stats().since(spec0)
            step_ms = (tn - t1) / STEPS * 1e3
            row = dict(batch=batch, sampling=name, step_ms=step_ms, bound_ms=bound_ms,
                       of_bound=bound_ms / step_ms, speculation=spec.as_dict())  # fmt: skip
            if profile:
                row["gpu_ms"] = gpu_ms_per_step(llm, prompts(), many, top=15 if batch == 1 else 0)
            result["rows"].append(row)
            gpu = f", GPU busy {row['gpu_ms']:.3f} ms" if profile else ""
            print(f"batch {batch:3d} {name:22s} {step_ms:.3f} ms/step (bound {bound_ms:.3f} ms, "
                  f"{100 * row['of_bound']:.0f}% of it){gpu}", flush=True)  # fmt: skip
            if speculative_config is not None:
                print(f"    speculation: {spec.describe()}", flush=True)
    return result


def _print_ratios(runs: dict) -> None:
    """Each format's step time against bf16's, per batch size and sampling setting."""
    base = {(r["batch"], r["sampling"]): r["step_ms"] for r in runs["bf16"]["rows"]}
    for name, run in runs.items():
        for r in run["rows"] if name != "bf16" else []:
            speedup = base[r["batch"], r["sampling"]] / r["step_ms"]
            print(f"{name:20s} batch {r['batch']:3d} {r['sampling']:22s} {r['step_ms']:.3f} ms/step"
                  f" = {speedup:.2f}x bf16's")  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    import bench

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--model-shape", default=None, help="dummy weights of bench.SHAPES'")
    parser.add_argument("--quantization", nargs="+", default=[],
                        help="with --model-shape: each format too")  # fmt: skip
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--profile", action="store_true", help="GPU kernel time per step")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--speculative-config", type=json.loads, default=None,
                        help="vLLM's speculative_config dict as JSON; step_ms is then the time "
                             "per output token")  # fmt: skip
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the latency benchmark needs CUDA")
    if args.model_shape is not None:
        runs = {}
        for quantization in [None, *args.quantization]:
            model_dir = bench.config_only(args.model_shape, quantization)
            runs[quantization or "bf16"] = run_latency(
                model_dir, args.batch, args.context, args.profile, args.enforce_eager, "dummy",
                args.speculative_config,
            )
            gc.collect()
            torch.cuda.empty_cache()
        _print_ratios(runs)
        if args.json:
            Path(args.json).write_text(json.dumps(runs, indent=2))
        return runs
    model_dir = Path(args.model) if args.model else bench.random_model(
        bench.QWEN3_0_6B, "qwen3-0.6b", "cuda")  # fmt: skip
    result = run_latency(model_dir, args.batch, args.context, args.profile, args.enforce_eager,
                         speculative_config=args.speculative_config)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
