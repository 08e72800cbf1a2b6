"""The MoE layer (Triton fused MoE) against the reference loop and the weight-read bound (GPU).

python benchmarks/moe_bench.py [--json PATH] [--sweep]

Qwen3-30B-A3B's experts: 128, top-8, hidden 2048, moe_intermediate 768, bf16. Per batch of
tokens (1, 64, 256 decode rows; 2048 a prefill chunk): device time of the whole layer (router,
top-k, fused_moe) eagerly and replayed from a CUDA graph (as decode runs; 4 layers in a row,
time per layer), of the same layer with fused_moe_ref's loop over experts, and the bound: the
expert weights the batch actually touches (distinct experts hit x 3 x hidden x inter x 2
bytes) read once at the copy rate measured in the same run. TB/s = those bytes / time.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

NUM_EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
BATCHES = [1, 64, 256, 2048]
GRAPH_LAYERS = 4
DEVICE = "cuda"


def bench_ms(fn, graph: bool = False) -> float:
    """Median device time of fn in ms (do_bench flushes L2 between runs)."""
    import triton.testing

    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def copy_bandwidth() -> float:
    """Device-to-device copy rate in TB/s, bytes read plus written."""
    x = torch.randn(512 * 2**20, device=DEVICE)  # 2 GiB
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x))
    return 2 * x.numel() * x.element_size() / ms / 1e9


def make_block():
    """A Qwen3-30B-A3B MoE layer on the GPU in bf16, weights of unit-scale outputs."""
    from nanopaged.layers.backend import backend_for, bind_backend
    from nanopaged.layers.moe import SparseMoeBlock

    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(DEVICE):
            block = SparseMoeBlock(HIDDEN, NUM_EXPERTS, TOP_K, INTER, norm_topk_prob=True)
    finally:
        torch.set_default_dtype(torch.float32)
    # A layer built outside a ModelRunner computes with the torch references until bound:
    # the Triton kernels, as a runner on this GPU binds them (the reference path cannot be
    # captured in a CUDA graph).
    bind_backend(block, backend_for(DEVICE))
    with torch.no_grad():
        block.gate.weight.normal_(0, HIDDEN**-0.5)
        block.experts.w13.normal_(0, HIDDEN**-0.5)
        block.experts.w2.normal_(0, INTER**-0.5)
    return block


def route(block, x):
    """The block's own routing: (topk_weights, topk_ids) for x."""
    probs = torch.softmax(block.gate(x), dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(TOP_K, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).to(x.dtype), ids


def rows(copy_tbs: float) -> list[dict]:
    from nanopaged.kernels.fused_moe import fused_moe_ref

    # Several layers back to back, as in a decode step, so the graph replay cannot find one
    # layer's experts still in L2 (do_bench flushes L2 between its eager calls instead).
    blocks = [make_block() for _ in range(GRAPH_LAYERS)]
    block = blocks[0]
    w13, w2 = block.experts.w13, block.experts.w2
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    out = []
    for batch in BATCHES:
        x = torch.randn(batch, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
        hits = [route(b, x)[1].unique().numel() for b in blocks]
        touched = hits[0] * expert_bytes
        bound_us = touched / (copy_tbs * 1e12) * 1e6
        with torch.inference_mode():
            layer_us = bench_ms(lambda x=x: block(x)) * 1e3
            all_us = bench_ms(lambda x=x: [b(x) for b in blocks], graph=True) * 1e3
            all_bound_us = sum(hits) * expert_bytes / (copy_tbs * 1e12) * 1e6

            def ref(x=x):
                w, i = route(block, x)
                return fused_moe_ref(x, w13, w2, w, i)

            ref_us = bench_ms(ref) * 1e3
            err = (block(x).float() - ref().float()).abs().max().item()
        graph_us = all_us / GRAPH_LAYERS
        row = dict(batch=batch, experts_hit=hits[0], touched_mb=touched / 1e6,
                   layer_us=layer_us, graph_us=graph_us, ref_us=ref_us, bound_us=bound_us,
                   layer_tbs=touched / layer_us / 1e6,
                   graph_tbs=sum(hits) * expert_bytes / all_us / 1e6,
                   layer_of_bound=bound_us / layer_us, graph_of_bound=all_bound_us / all_us,
                   ref_over_layer=ref_us / layer_us, max_abs_err=err)  # fmt: skip
        out.append(row)
        print(f"moe B={batch:5d} hit {hits[0]:3d}/{NUM_EXPERTS} ({row['touched_mb']:6.1f} MB): "
              f"layer {layer_us:8.1f} µs = {row['layer_tbs']:.2f} TB/s = "
              f"{100 * row['layer_of_bound']:4.1f}% of its {bound_us:.1f} µs bound; in a graph "
              f"{graph_us:8.1f} µs = {row['graph_tbs']:.2f} TB/s = "
              f"{100 * row['graph_of_bound']:4.1f}%; ref loop {ref_us:9.1f} µs "
              f"({row['ref_over_layer']:.1f}x the layer); max |err| {err:.1e}",
              flush=True)  # fmt: skip
    return out


def sweep() -> list[dict]:
    """Every launch config at each batch: which tiles the default table should pick."""
    from nanopaged.kernels.fused_moe import fused_moe, tile_config

    block = make_block()
    w13, w2 = block.experts.w13, block.experts.w2
    results = []
    for batch in BATCHES:
        x = torch.randn(batch, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
        weights, ids = route(block, x)
        default = tile_config(batch * TOP_K, NUM_EXPERTS)
        args = (x, w13, w2, weights, ids)
        timed = []
        for bm, bn, bk, (warps, stages) in itertools.product(
            [16, 32, 64], [32, 64, 128], [64, 128], [(4, 3), (8, 4)]
        ):
            cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
            try:
                us = bench_ms(lambda c=cfg, a=args: fused_moe(*a, c)) * 1e3
            except Exception as e:  # noqa: BLE001 - a config past the chip's limits
                print(f"  skip {cfg}: {type(e).__name__}")
                continue
            timed.append((us, cfg))
        timed.sort(key=lambda t: t[0])
        default_us = bench_ms(lambda a=args: fused_moe(*a)) * 1e3
        print(f"sweep B={batch}: default {default} {default_us:.1f} µs; best:")
        for us, cfg in timed[:5]:
            print(f"    {us:8.1f} µs {cfg}")
        results.append(dict(batch=batch, default_us=default_us, timed=timed))
    return results


def main(argv: list[str] | None = None) -> list[dict]:
    """Print one row per batch size; optionally sweep launch configs and write JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write the rows to this path")
    parser.add_argument("--sweep", action="store_true", help="also time every launch config")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("moe_bench needs a CUDA device")
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    copy_tbs = copy_bandwidth()
    print(f"{device}; copy {copy_tbs:.2f} TB/s; experts {NUM_EXPERTS}, top-{TOP_K}, "
          f"hidden {HIDDEN}, moe_intermediate {INTER}, bf16")  # fmt: skip
    result = rows(copy_tbs)
    swept = sweep() if args.sweep else None
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, copy_tbs=copy_tbs, rows=result, sweep=swept), f,
                      indent=1)  # fmt: skip
    return result


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
