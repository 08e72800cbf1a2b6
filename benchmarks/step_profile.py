"""Where one decode step's time goes: host work, graph replay, sampler, and top GPU kernels.

python benchmarks/step_profile.py [--model PATH] [--batch 256] [--context 1000]
    [--kv-cache-dtype fp8]
python benchmarks/step_profile.py --model-shape qwen3-32b --tensor-parallel-size 2
(--model-shape: random weights of that shape, load_format="dummy"; the profile is rank 0's)
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> None:
    import bench
    from nanopaged import LLM, SamplingParams
    from nanopaged.engine.sequence import Sequence

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--temperature", type=float, default=0.6, help="0: greedy")
    parser.add_argument("--model-shape", choices=list(bench.SHAPES), default=None)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args(argv)
    if args.model_shape is not None:
        model_dir, load_format = bench.config_only(args.model_shape), "dummy"
    else:
        model_dir = args.model or bench.random_model(bench.QWEN3_0_6B, "qwen3-0.6b", "cuda")
        load_format = "auto"
    llm = LLM(str(model_dir), max_model_len=4096, enforce_eager=args.eager,
              tensor_parallel_size=args.tensor_parallel_size, load_format=load_format,
              kv_cache_dtype=args.kv_cache_dtype)  # fmt: skip
    random.seed(0)
    params = SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=4000)
    s, runner = llm.scheduler, llm.runner
    for _ in range(args.batch):
        s.add(Sequence([random.randint(0, 10000) for _ in range(args.context)], params))
    while s.waiting or any(q.num_computed_tokens < len(q) - 1 for g in s.running for q in g.seqs):
        b = s.schedule()
        tokens = runner.run(b, llm.eos_token_ids)
        s.advance(b)
        s.commit(b, tokens)

    def timed(n: int) -> dict[str, float]:
        t = {"schedule": 0.0, "run": 0.0, "commit": 0.0}
        for _ in range(n):
            t0 = time.perf_counter()
            b = s.schedule()
            t1 = time.perf_counter()
            tokens = runner.run(b, llm.eos_token_ids)
            t2 = time.perf_counter()
            s.advance(b)
            s.commit(b, tokens)
            t3 = time.perf_counter()
            t["schedule"] += t1 - t0
            t["run"] += t2 - t1
            t["commit"] += t3 - t2
        return {k: 1000 * v / n for k, v in t.items()}

    timed(5)
    step = timed(args.steps)
    print(
        f"batch {len(s.running)} context ~{args.context}: per step (ms) "
        + ", ".join(f"{k} {v:.2f}" for k, v in step.items())
    )
    graphs = runner.graphs
    if graphs is not None and args.tensor_parallel_size == 1:  # TP: the workers must replay too
        bs = len(s.running)
        bucket = min(b for b in graphs.batch_sizes if b >= bs)
        g = graphs.graphs[bucket]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            g.replay()
        end.record()
        end.synchronize()
        print(f"graph replay alone (bucket {bucket}): {start.elapsed_time(end) / 20:.2f} ms")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed(5)
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
