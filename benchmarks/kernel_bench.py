"""Paged decode/prefill kernels against contiguous torch SDPA on the same data (GPU only).

Each decode case also runs on an fp8 (e4m3) copy of its cache in the engine's layout (V
channel-major), "decode fp8": TB/s of the 8-bit KV it reads; its ratio is to bf16 SDPA's time.

python benchmarks/kernel_bench.py [--json PATH] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

BLOCK_SIZE = 16
HEAD_DIM = 128
HEAD_LAYOUTS = [(16, 8), (32, 8)]  # (num_heads, num_kv_heads): Qwen3-0.6B, Llama-3-8B
DECODE_CASES = [(256, 1024), (64, 4096), (8, 8192)]  # (batch, context_len)
# (batch, q_len, cached prefix) per sequence; 8k-16k query tokens each.
PREFILL_CASES = [(16, 512, 0), (8, 1024, 1024), (4, 4096, 0)]


def bench_ms(fn, rep: int = 200) -> float:
    """Median device time of fn in ms (do_bench flushes L2 between runs)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def copy_bandwidth() -> float:
    """Device-to-device copy rate in TB/s, bytes read plus written."""
    x = torch.randn(512 * 2**20, device="cuda")  # 2 GiB
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x))
    return 2 * x.numel() * x.element_size() / ms / 1e9


def paged_copy(
    k: torch.Tensor, v: torch.Tensor, num_spare_blocks: int = 64
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contiguous k/v [batch, num_kv_heads, L, D] scattered into a cache via shuffled tables."""
    batch, num_kv_heads, length, head_dim = k.shape
    blocks_per_seq = -(-length // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + num_spare_blocks
    perm = torch.randperm(num_blocks, device=k.device)[: batch * blocks_per_seq]
    block_tables = perm.view(batch, blocks_per_seq).to(torch.int32)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=k.device, dtype=k.dtype)
    v_cache = torch.randn(shape, device=k.device, dtype=k.dtype)
    pad = blocks_per_seq * BLOCK_SIZE - length
    for src, cache in ((k, k_cache), (v, v_cache)):
        # src: [batch, kv, L, D] -> [batch * blocks_per_seq, BLOCK_SIZE, kv, D]
        tokens = F.pad(src.transpose(1, 2), (0, 0, 0, 0, 0, pad))
        cache[perm.long()] = tokens.reshape(-1, BLOCK_SIZE, num_kv_heads, head_dim)
    return k_cache, v_cache, block_tables


def sdpa_gqa(q, k, v, is_causal=False):
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    except (TypeError, RuntimeError):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


def decode_rows() -> list[dict]:
    from nanopaged.kernels.paged_decode import (
        choose_num_splits,
        decode_config,
        num_sms,
        paged_decode,
    )
    from nanopaged.kernels.store_kv import channel_major

    rows = []
    dtype = torch.bfloat16
    for num_heads, num_kv_heads in HEAD_LAYOUTS:
        for batch, length in DECODE_CASES:
            q = torch.randn(batch, num_heads, 1, HEAD_DIM, device="cuda", dtype=dtype)
            k = torch.randn(batch, num_kv_heads, length, HEAD_DIM, device="cuda", dtype=dtype)
            v = torch.randn_like(k)
            k_cache, v_cache, block_tables = paged_copy(k, v)
            context_lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
            scale = HEAD_DIM**-0.5
            q3 = q[:, :, 0]
            args = (q3, k_cache, v_cache, block_tables, context_lens, scale)
            out = paged_decode(*args, max_context_len=length)
            ref = sdpa_gqa(q, k, v)[:, :, 0]
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            t_paged = bench_ms(lambda a=args, n=length: paged_decode(*a, max_context_len=n))
            t_sdpa = bench_ms(lambda q=q, k=k, v=v: sdpa_gqa(q, k, v))
            kv_bytes = 2 * k.numel() * k.element_size()
            block_n, _, _ = decode_config(HEAD_DIM, dtype)
            splits = choose_num_splits(batch, num_kv_heads, length, block_n, num_sms(q.device))
            common = dict(heads=f"{num_heads}q/{num_kv_heads}kv", shape=f"B={batch} L={length}",
                          sdpa_us=t_sdpa * 1e3, sdpa_tbs=kv_bytes / t_sdpa / 1e9, splits=splits)
            rows.append(dict(
                kernel="decode", **common, paged_us=t_paged * 1e3,
                paged_tbs=kv_bytes / t_paged / 1e9, ratio=t_paged / t_sdpa, rel_err=err,
            ))
            # The same cache in fp8 e4m3 (scales 1.0): half the bytes to read, V channel-major
            # as the engine keeps it. Its error is against bf16 SDPA on the unquantized K/V,
            # i.e. mostly the 8-bit rounding.
            k8 = k_cache.to(torch.float8_e4m3fn)
            v8 = channel_major(torch.empty_like(k8))
            v8.copy_(v_cache.to(torch.float8_e4m3fn))
            one = torch.ones(1, device="cuda")
            args8 = (q3, k8, v8, block_tables, context_lens, scale)
            out8 = paged_decode(*args8, max_context_len=length, k_scale=one, v_scale=one)
            err8 = ((out8.float() - ref.float()).norm() / ref.float().norm()).item()
            t8 = bench_ms(lambda a=args8, n=length, s=one: paged_decode(
                *a, max_context_len=n, k_scale=s, v_scale=s))
            block_n8, _, _ = decode_config(HEAD_DIM, dtype, k8.dtype)
            splits8 = choose_num_splits(batch, num_kv_heads, length, block_n8, num_sms(q.device))
            rows.append(dict(
                kernel="decode fp8", **{**common, "splits": splits8}, paged_us=t8 * 1e3,
                paged_tbs=kv_bytes / 2 / t8 / 1e9, ratio=t8 / t_sdpa, rel_err=err8,
            ))
            del k8, v8
            del k_cache, v_cache, k, v
    return rows


def prefill_flops(batch: int, q_len: int, prefix: int, num_heads: int) -> float:
    # Causal: query j sees prefix + j + 1 keys; QK^T and PV are 2 * D flops per key each.
    visible = q_len * prefix + q_len * (q_len + 1) / 2
    return 4 * HEAD_DIM * visible * num_heads * batch


def prefill_rows() -> list[dict]:
    from torch.nn.attention.bias import causal_lower_right

    from nanopaged.kernels.paged_prefill import paged_prefill

    rows = []
    dtype = torch.bfloat16
    for num_heads, num_kv_heads in HEAD_LAYOUTS:
        group = num_heads // num_kv_heads
        for batch, q_len, prefix in PREFILL_CASES:
            length = prefix + q_len
            q = torch.randn(batch, num_heads, q_len, HEAD_DIM, device="cuda", dtype=dtype)
            k = torch.randn(batch, num_kv_heads, length, HEAD_DIM, device="cuda", dtype=dtype)
            v = torch.randn_like(k)
            k_cache, v_cache, block_tables = paged_copy(k, v)
            context_lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
            cu = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * q_len
            # q_packed: [batch * q_len, num_heads, D]
            q_packed = q.transpose(1, 2).reshape(-1, num_heads, HEAD_DIM).contiguous()
            scale = HEAD_DIM**-0.5
            args = (q_packed, k_cache, v_cache, block_tables, cu, context_lens, scale, q_len)
            # The engine's call: this step's K/V (the last q_len positions) also passed packed,
            # read contiguously; the prefix through the block table.
            k_new, v_new = (x[:, :, prefix:].transpose(1, 2).reshape(-1, num_kv_heads, HEAD_DIM)
                            for x in (k, v))  # fmt: skip
            fresh = dict(k_new=k_new, v_new=v_new, has_prefix=prefix > 0)
            out = paged_prefill(*args, **fresh)
            out_paged_only = paged_prefill(*args)
            # SDPA baseline on MHA-expanded K/V (expansion outside the timing).
            k_rep = k.repeat_interleave(group, 1)
            v_rep = v.repeat_interleave(group, 1)
            if prefix:
                mask = causal_lower_right(q_len, length)

                def sdpa(mask=mask, k_rep=k_rep, v_rep=v_rep, q=q):
                    return F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask)
            else:

                def sdpa(k_rep=k_rep, v_rep=v_rep, q=q):
                    return F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True)

            ref = sdpa().transpose(1, 2).reshape(-1, num_heads, HEAD_DIM)
            t_sdpa = bench_ms(sdpa)
            flops = prefill_flops(batch, q_len, prefix, num_heads)
            shape = f"{batch}x{q_len}" + (f"+{prefix} cached" if prefix else "")
            for kernel, o, kwargs in (("prefill", out, fresh),
                                      ("prefill, all K/V paged", out_paged_only, {})):
                err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
                t_paged = bench_ms(lambda a=args, kw=kwargs: paged_prefill(*a, **kw))
                rows.append(dict(
                    kernel=kernel, heads=f"{num_heads}q/{num_kv_heads}kv", shape=shape,
                    paged_us=t_paged * 1e3, sdpa_us=t_sdpa * 1e3,
                    paged_tflops=flops / t_paged / 1e9, sdpa_tflops=flops / t_sdpa / 1e9,
                    ratio=t_sdpa / t_paged, rel_err=err,
                ))
            del k_cache, v_cache, k, v, k_rep, v_rep
    return rows


def sweep(json_path: str | None, only: str | None = None) -> None:
    """Time launch-config variants (bf16; decode also over an e4m3 cache) to pick the
    launchers' defaults; only: "decode" or "prefill"."""
    results = []
    if only != "prefill":
        results += sweep_decode() + sweep_decode_fp8()
    if only != "decode":
        results += sweep_prefill()
    if json_path:
        with open(json_path.replace(".json", "_sweep.json"), "w") as f:
            json.dump(results, f)


def sweep_decode() -> list[dict]:
    from nanopaged.kernels.paged_decode import paged_decode_launch

    results = []
    dtype = torch.bfloat16
    decode_cfgs = [(64, 4, 3, True), (64, 4, 3, False), (128, 4, 3, True), (128, 4, 3, False),
                   (64, 4, 2, True), (128, 4, 4, True), (32, 4, 3, True)]
    for batch, length in [(8, 8192), (2, 16384), (32, 2048), (128, 1024), (256, 1024)]:
        q = torch.randn(batch, 16, HEAD_DIM, device="cuda", dtype=dtype)
        k = torch.randn(batch, 8, length, HEAD_DIM, device="cuda", dtype=dtype)
        k_cache, v_cache, block_tables = paged_copy(k, torch.randn_like(k))
        context_lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
        args = (q, k_cache, v_cache, block_tables, context_lens, HEAD_DIM**-0.5)
        timed = []
        for splits in (1, 2, 3, 4, 6, 8, 12, 16, 32):
            if batch >= 128 and splits > 2:
                continue
            for cfg in decode_cfgs:
                c = (splits, *cfg)
                try:
                    ms = bench_ms(lambda a=args, c=c: paged_decode_launch(*a, *c), 50)
                except Exception as e:  # noqa: BLE001 - a config past the chip's limits
                    print(f"  skip {c}: {type(e).__name__}: {str(e)[:80]}")
                    continue
                timed.append((ms * 1e3, c))
        timed.sort()
        kv_bytes = 2 * k.numel() * k.element_size()
        results.append(dict(kernel="decode", case=f"B={batch} L={length}", timed=timed))
        print(f"decode B={batch} L={length} (us, TB/s, (splits, BLOCK_N, warps, stages, prefetch))")
        for t, c in timed[:8]:
            print(f"    {t:7.1f} {kv_bytes / t / 1e6:5.2f} {c}")
        del k_cache, v_cache, k
    return results


def sweep_decode_fp8() -> list[dict]:
    """The 8-bit cache (e4m3, V channel-major) with a bf16 q: the transposed path's choices,
    (BLOCK_N, warps, stages, group_pad, offsets32) at the split count the launcher picks."""
    from nanopaged.kernels.paged_decode import choose_num_splits, num_sms, paged_decode_launch
    from nanopaged.kernels.store_kv import channel_major

    results = []
    dtype = torch.bfloat16
    fp8_cfgs = [(64, 2, 3, 16, False), (64, 2, 3, 8, False), (64, 2, 3, 8, True),
                (32, 1, 3, 8, True), (64, 2, 2, 8, True), (64, 2, 4, 8, True),
                (128, 2, 3, 8, True), (64, 1, 3, 8, True), (32, 2, 3, 8, True),
                (32, 2, 4, 8, True)]
    one = torch.ones(1, device="cuda")
    for batch, length in [(256, 1024), (64, 4096), (8, 8192)]:
        q = torch.randn(batch, 16, HEAD_DIM, device="cuda", dtype=dtype)
        k = torch.randn(batch, 8, length, HEAD_DIM, device="cuda", dtype=dtype)
        k_cache, v_cache, block_tables = paged_copy(k, torch.randn_like(k))
        k8 = k_cache.to(torch.float8_e4m3fn)
        v8 = channel_major(torch.empty_like(k8))
        v8.copy_(v_cache.to(torch.float8_e4m3fn))
        context_lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
        args = (q, k8, v8, block_tables, context_lens, HEAD_DIM**-0.5)
        timed = []
        for block_n, warps, stages, group_pad, offsets32 in fp8_cfgs:
            splits = choose_num_splits(batch, 8, length, block_n, num_sms(q.device))
            c = (splits, block_n, warps, stages, group_pad, offsets32)
            ms = bench_ms(lambda a=args, c=c: paged_decode_launch(
                *a, *c[:4], k_scale=one, v_scale=one, group_pad=c[4], offsets32=c[5]), 50)
            timed.append((ms * 1e3, c))
        timed.sort()
        kv_bytes = k.numel() * 2  # one byte a value, K and V
        results.append(dict(kernel="decode fp8", case=f"B={batch} L={length}", timed=timed))
        print(f"decode fp8 B={batch} L={length} (us, TB/s of 8-bit KV, "
              f"(splits, BLOCK_N, warps, stages, group_pad, offsets32))")  # fmt: skip
        for t, c in timed:
            print(f"    {t:7.1f} {kv_bytes / t / 1e6:5.2f} {c}")
        del k_cache, v_cache, k8, v8, k
    return results


def sweep_prefill() -> list[dict]:
    from nanopaged.kernels.paged_prefill import paged_prefill_launch

    results = []
    dtype = torch.bfloat16
    prefill_cfgs = [(64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3), (128, 64, 8, 4),
                    (64, 32, 4, 2), (64, 32, 4, 3), (128, 128, 8, 3), (64, 128, 4, 3),
                    (128, 32, 4, 2)]
    variants = [(1, False), (1, True), (2, False), (2, True)]
    for num_heads, num_kv_heads in HEAD_LAYOUTS:
        for batch, q_len, prefix in PREFILL_CASES:
            length = prefix + q_len
            q = torch.randn(batch * q_len, num_heads, HEAD_DIM, device="cuda", dtype=dtype)
            k = torch.randn(batch, num_kv_heads, length, HEAD_DIM, device="cuda", dtype=dtype)
            k_cache, v_cache, block_tables = paged_copy(k, torch.randn_like(k))
            context_lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
            cu = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * q_len
            args = (q, k_cache, v_cache, block_tables, cu, context_lens, HEAD_DIM**-0.5, q_len)
            flops = prefill_flops(batch, q_len, prefix, num_heads)
            timed = []
            for cfg in prefill_cfgs:
                for variant in variants:
                    c = (*cfg, *variant)
                    try:
                        ms = bench_ms(lambda a=args, c=c: paged_prefill_launch(*a, *c), 50)
                    except Exception as e:  # noqa: BLE001 - a config past the chip's limits
                        print(f"  skip {c}: {type(e).__name__}: {str(e)[:80]}")
                        continue
                    timed.append((flops / ms / 1e9, c))
            timed.sort(reverse=True)
            case = f"{num_heads}/{num_kv_heads} {batch}x{q_len}+{prefix}"
            results.append(dict(kernel="prefill", case=case, timed=timed))
            print(f"prefill {case} (TFLOP/s, (BLOCK_M, BLOCK_N, warps, stages, prefetch, pack))")
            for t, c in timed[:8]:
                print(f"    {t:5.0f} {c}")
            del k_cache, v_cache, k
    return results


def markdown(rows: list[dict], device: str, copy_tbs: float) -> str:
    lines = [f"device: {device}; device-to-device copy: {copy_tbs:.2f} TB/s (read + write)", ""]
    lines += ["| kernel | heads | shape | paged µs | SDPA µs | paged | SDPA | ratio | rel err |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["kernel"].startswith("decode"):
            rates = f"{r['paged_tbs']:.2f} TB/s | {r['sdpa_tbs']:.2f} TB/s"
            ratio = f"{r['ratio']:.3f}× time (splits {r['splits']})"
        else:
            rates = f"{r['paged_tflops']:.0f} TFLOP/s | {r['sdpa_tflops']:.0f} TFLOP/s"
            ratio = f"{r['ratio']:.3f}× throughput"
        lines.append(f"| {r['kernel']} | {r['heads']} | {r['shape']} | {r['paged_us']:.1f} | "
                     f"{r['sdpa_us']:.1f} | {rates} | {ratio} | {r['rel_err']:.1e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the kernel benchmarks, print a markdown table, optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write the rows to this path")
    parser.add_argument("--sweep", action="store_true", help="also time launch-config variants")
    parser.add_argument("--only", choices=["decode", "prefill"], help="run one kernel's cases")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernel_bench needs a CUDA device")
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    copy_tbs = copy_bandwidth()
    rows = []
    if args.only != "prefill":
        rows += decode_rows()
    if args.only != "decode":
        rows += prefill_rows()
    print(markdown(rows, device, copy_tbs))
    if args.sweep:
        sweep(args.json, args.only)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device, copy_tbs=copy_tbs, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    main()
