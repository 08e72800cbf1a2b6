"""The fused sort-free sampler against the torch sort path (GPU only).

python benchmarks/sampler_bench.py [--json PATH]

Per setting and batch size: device time of nanopaged.kernels.sampler_chunks.sample_fused against
nanopaged.sampling.ops.sample (plus log_softmax/topk when logprobs are asked for), seeded rows
through per-row torch.Generators as the engine does today. bf16 logits, Qwen's 151,936 vocab.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from sort_sampler import SamplingTensors, sample

from nanopaged.kernels.sampler_chunks import sample_fused

VOCAB = 151_936
BATCHES = [256, 8]
# name -> (temperature, top_k, top_p, min_p, seeded, num_logprobs); top_k 0 = off.
SETTINGS = {
    "top_p=0.95": (1.0, 0, 0.95, 0.0, False, 0),
    "top_k=40": (1.0, 40, 1.0, 0.0, False, 0),
    "min_p=0.05": (1.0, 0, 1.0, 0.05, False, 0),
    "seeded": (1.0, 0, 1.0, 0.0, True, 0),
    "logprobs=5": (1.0, 0, 1.0, 0.0, False, 5),
    "all combined": (0.8, 40, 0.95, 0.05, True, 5),
}


def time_ms(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median of CUDA-event times of fn over iters calls, after warmup calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graph_ms(fn, calls: int = 10, replays: int = 10) -> float | None:
    """Device time of one fn call from a CUDA graph of `calls` calls (median of replays), which
    leaves out the host's launch work as the engine's asynchronous steps do; None when fn
    cannot be captured."""
    fn()  # compiles and warms up outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream), torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except RuntimeError:
        torch.cuda.synchronize()
        return None
    torch.cuda.current_stream().wait_stream(stream)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def make_logits(batch: int, device: torch.device) -> torch.Tensor:
    # A peaked head over a long flat tail, roughly what an LM head gives.
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(batch, VOCAB, device=device, generator=gen) * 2.5
    return logits.to(torch.bfloat16)


def torch_path(logits: torch.Tensor, setting: tuple, seed_list: list[int]):
    """The sort path as the engine runs it: SamplingTensors, generators, then logprobs."""
    temp, top_k, top_p, min_p, seeded, num_logprobs = setting
    batch, vocab = logits.shape
    dev = logits.device

    def run():
        generators = [None] * batch
        if seeded:
            generators = [torch.Generator(device=dev).manual_seed(s) for s in seed_list]
        st = SamplingTensors(
            temperatures=torch.full((batch,), temp, device=dev),
            top_ps=torch.full((batch,), top_p, device=dev),
            top_ks=torch.full((batch,), top_k if top_k > 0 else vocab, device=dev),
            min_ps=torch.full((batch,), min_p, device=dev),
            generators=generators,
            all_greedy=temp == 0,
            any_top_p_k=top_p < 1 or 0 < top_k < vocab,
            any_min_p=min_p > 0,
        )
        tokens = sample(logits, st, None)
        if num_logprobs:
            lp = logits.float().log_softmax(dim=-1)
            lp.topk(num_logprobs, dim=-1)
            lp.gather(1, tokens[:, None])
        return tokens

    return run


def fused_path(logits: torch.Tensor, setting: tuple, seed_list: list[int], **launch):
    temp, top_k, top_p, min_p, seeded, num_logprobs = setting
    batch = logits.shape[0]
    dev = logits.device
    temps = torch.full((batch,), temp, dtype=torch.float32, device=dev)
    top_ks = torch.full((batch,), top_k, dtype=torch.int32, device=dev)
    top_ps = torch.full((batch,), top_p, dtype=torch.float32, device=dev)
    min_ps = torch.full((batch,), min_p, dtype=torch.float32, device=dev)
    seeds = torch.tensor(seed_list, dtype=torch.int64, device=dev)
    offsets = torch.zeros(batch, dtype=torch.int64, device=dev)

    # As the engine calls it: the sampled tokens' own logprobs only with top logprobs, rows
    # without top-k or top-p flagged plain, rows without top-k so (SamplingTensors.all_plain,
    # any_min_p, any_top_k).
    plain = top_k <= 0 and top_p == 1.0

    def run():
        offsets.add_(1)  # a new position each step, as in decode
        return sample_fused(logits, temps, top_ks, top_ps, min_ps, seeds, offsets, num_logprobs,
                            logprobs=num_logprobs > 0, plain=plain, min_p=min_p > 0,
                            top_k=top_k > 0, **launch)  # fmt: skip

    return run


def run_sampler_bench(device: str | torch.device = "cuda", **launch) -> list[dict]:
    """One row per (batch, setting): fused and torch ms and their ratio.

    launch: block / num_warps for sample_fused, to try other tilings than its default.
    """
    device = torch.device(device)
    rows = []
    for batch in BATCHES:
        logits = make_logits(batch, device)
        seed_list = list(range(1000, 1000 + batch))
        for name, setting in SETTINGS.items():
            fused_ms = time_ms(fused_path(logits, setting, seed_list, **launch))
            torch_ms = time_ms(torch_path(logits, setting, seed_list))
            fused_dev = graph_ms(fused_path(logits, setting, seed_list, **launch))
            rows.append(dict(batch=batch, setting=name, fused_ms=round(fused_ms, 4),
                             torch_ms=round(torch_ms, 4), speedup=round(torch_ms / fused_ms, 2),
                             fused_device_ms=round(fused_dev, 4)))  # fmt: skip
            print(f"{batch:>5}  {name:<14} {fused_ms:9.3f} {torch_ms:9.3f} "
                  f"{torch_ms / fused_ms:8.1f}x {fused_dev:11.3f}", flush=True)
    return rows


# (block, num_warps, programs_per_sm) that --tune tries
TUNE = [(b, w, p) for b in (1024, 2048, 4096) for w in (4, 8, 16) for p in (1, 2, 4)
        if b // (32 * w) >= 2]  # fmt: skip


def tune_sampler(device: str | torch.device = "cuda") -> None:
    """Each setting's fused time under every TUNE tiling, the fastest first."""
    device = torch.device(device)
    for batch in BATCHES:
        logits = make_logits(batch, device)
        seed_list = list(range(1000, 1000 + batch))
        for name, setting in SETTINGS.items():
            times = []
            for block, warps, pps in TUNE:
                run = fused_path(logits, setting, seed_list, block=block, num_warps=warps,
                                 programs_per_sm=pps)  # fmt: skip
                times.append((graph_ms(run), f"block {block} warps {warps} per SM {pps}"))
            times.sort()
            default = graph_ms(fused_path(logits, setting, seed_list))
            best = "; ".join(f"{ms:.3f} ms {cfg}" for ms, cfg in times[:4])
            print(f"{batch:>5}  {name:<14} default {default:.3f} ms; {best}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--block", type=int, help="sample_fused BLOCK (default: its own)")
    parser.add_argument("--num-warps", type=int, help="sample_fused num_warps")
    parser.add_argument("--tune", action="store_true", help="sweep the kernel's tilings")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sampler_bench needs a CUDA device")
    print(f"{torch.cuda.get_device_name()}, vocab {VOCAB}, bf16 logits")
    if args.tune:
        tune_sampler("cuda")
        return
    print(f"{'batch':>5}  {'setting':<14} {'fused ms':>9} {'torch ms':>9} {'speedup':>9} "
          f"{'fused, graph':>12}")  # fmt: skip
    launch = {k: v for k, v in (("block", args.block), ("num_warps", args.num_warps)) if v}
    rows = run_sampler_bench("cuda", **launch)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
