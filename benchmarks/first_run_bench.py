"""The first generate() on a fresh LLM against the second, on the ShareGPT-like workload.

python benchmarks/first_run_bench.py [--model PATH] [--requests 400] [--json PATH]

A user's first call pays whatever the engine left for later: Triton kernel variants first
launched (a compile, or a load from Triton's disk cache), cuBLAS picking algorithms for new
shapes, the caching allocator growing, one-time tables. The LLM is built (timed), then the
workload of `bench.py --sampling` (400 requests, lognormal lengths, greedy, ignore_eos) runs
twice with nothing in between; the second run's prompts start with a token of their own, so
it finds nothing of the first in the prefix cache. Reported: both wall times, their ratio
(target <= 1.05), and the kernel variants first launched inside each run. Default model:
bench.py's random Qwen3-0.6B-shaped one (CUDA); without CUDA, its tiny model on 32 requests.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import QWEN3_0_6B, TINY, add_tokenizer, new_kernel_variants, random_model, sharegpt_like


def _timed_run(llm, prompts, outputs) -> dict:
    from nanopaged import SamplingParams

    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=m) for m in outputs]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with new_kernel_variants(detail=True) as variants:
        started = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return dict(seconds=seconds, output_tokens=tokens, tok_per_s=tokens / seconds,
                kernel_variants=sorted(set(variants)))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=None, help="default 400 (CPU: 32)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from nanopaged import LLM

    cuda = torch.cuda.is_available()
    shape, name = (QWEN3_0_6B, "qwen3-0.6b") if cuda else (TINY, "qwen3-tiny")
    device = "cuda" if cuda else "cpu"
    model_dir = Path(args.model) if args.model else random_model(shape, name, device)
    if not args.model:
        add_tokenizer(model_dir, shape["vocab_size"])
    prompts, outputs = sharegpt_like(args.requests or (400 if cuda else 32))
    if not cuda:
        prompts, outputs = [p[:128] for p in prompts], [min(m, 32) for m in outputs]
    started = time.perf_counter()
    llm = LLM(str(model_dir), max_model_len=4096, **({} if cuda else {"device": "cpu"}))
    startup = time.perf_counter() - started
    # Token ids below 30,000 exist in every vocabulary here; each run starts with its own.
    runs = [_timed_run(llm, [[29990 + k, *(t % 29990 for t in p)] for p in prompts], outputs)
            for k in range(2)]  # fmt: skip
    name = torch.cuda.get_device_name() if cuda else "cpu"
    ratio = runs[0]["seconds"] / runs[1]["seconds"]
    result = dict(device=name, startup_s=startup, first=runs[0], second=runs[1], ratio=ratio)
    print(f"{result['device']}: LLM ready in {startup:.2f} s")
    for label, run in zip(("first", "second"), runs):
        print(f"{label:6s} generate: {run['seconds']:.3f} s, {run['tok_per_s']:.0f} tok/s; "
              f"kernel variants first launched: {len(run['kernel_variants'])} "
              f"{run['kernel_variants']}", flush=True)
    print(f"first / second: {result['ratio']:.3f} (target <= 1.05)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
