"""The peer all-reduce kernel against NCCL's all-reduce on two GPUs, both replayed from CUDA
graphs as decode steps replay them, at a Qwen3-32B row width (5120) in bf16.

python benchmarks/all_reduce_bench.py [--hidden 5120] [--world 2] [--sweep] [--tune]
(--tune: the peer kernel's time for each block size, program cap and warp count)
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanopaged.distributed.parallel import PEER_ALL_REDUCE_ENV  # noqa: E402

ROWS = (1, 8, 64, 256, 1024)
CALLS = 20  # sums per graph


def graph_us(fn, replays: int = 50) -> float:
    """Microseconds per call of fn, from a graph of CALLS calls (median of 5 timings)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(1000 * start.elapsed_time(end) / (replays * CALLS))
    return sorted(times[1:])[2]


TUNE_BLOCKS = (2048, 4096, 8192)
TUNE_CAPS = (64, 128)
TUNE_WARPS = (4, 8)


def rank_main(rank: int, world: int, hidden: int, sweep: bool, tune: bool) -> None:
    import torch.distributed as dist

    from nanopaged.distributed.parallel import TensorParallel
    from nanopaged.kernels.rms_norm import rms_norm

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", 29561, world, is_master=rank == 0)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=device)
    tp = TensorParallel(rank, world, dist.group.WORLD)
    assert tp.enable_peer_all_reduce(device), "no peer access between the GPUs"
    lines = []
    for rows in ROWS:
        # Values that stay finite however often they are summed in place.
        x = torch.zeros(rows, hidden, dtype=torch.bfloat16, device=device)
        nccl = graph_us(lambda x=x: dist.all_reduce(x))
        peer = graph_us(lambda x=x: tp.peer.all_reduce(x))
        mb = x.numel() * x.element_size() / 1e6
        line = (f"{rows:5d} x {hidden} bf16 ({mb:6.2f} MB): NCCL {nccl:6.1f} us, peer "
                f"{peer:6.1f} us = {nccl / peer:4.2f}x")  # fmt: skip
        # The sum with the residual add and RMSNorm after it: two kernels, or the fused one.
        residual, weight = torch.zeros_like(x), torch.ones(hidden, dtype=x.dtype, device=device)
        def apart(x=x, r=residual, w=weight):
            tp.peer.all_reduce(x)
            rms_norm(x, w, 1e-6, r)

        apart_us = graph_us(apart)
        fused_us = graph_us(lambda x=x, r=residual, w=weight: tp.peer.all_reduce_rms_norm(
            x, r, w, 1e-6))  # fmt: skip
        line += f"; + add + norm: {apart_us:6.1f} us apart, {fused_us:6.1f} us fused"
        if sweep:
            for programs in (8, 32):
                us = graph_us(lambda x=x, p=programs: tp.peer.all_reduce(x, max_programs=p))
                line += f"; {programs} programs {us:6.1f} us"
        lines.append(line)
        if tune:
            best = []
            for push, block, cap, warps in itertools.product(
                (False, True), TUNE_BLOCKS, TUNE_CAPS, TUNE_WARPS
            ):
                us = graph_us(lambda x=x, kw=dict(push=push, block=block, max_programs=cap,
                                                  num_warps=warps): tp.peer.all_reduce(x, **kw))
                mode = "push" if push else "pull"
                best.append((us, f"{mode} block {block} cap {cap} warps {warps}"))
            best.sort()
            lines += [f"    {us:6.1f} us  {name}" for us, name in best[:6]]
    if rank == 0:
        name = torch.cuda.get_device_name()
        print(f"all-reduce over {world} x {name}, from CUDA graphs:\n" + "\n".join(lines))
    tp.release()
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--sweep", action="store_true", help="also cap the program count")
    parser.add_argument("--tune", action="store_true", help="sweep the launch settings")
    args = parser.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.pop(PEER_ALL_REDUCE_ENV, None)
    mp.spawn(rank_main, args=(args.world, args.hidden, args.sweep, args.tune), nprocs=args.world)


if __name__ == "__main__":
    main()
