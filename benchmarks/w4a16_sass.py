"""SASS instructions per weight in the W4A16 kernels' main loop, offline for sm_90 (no GPU).

python benchmarks/w4a16_sass.py [--rows 1 4 8 16] [--kinds awq gptq] [--shapes ...] [--dump DIR]

For each Qwen3-8B projection shape and row count, the launch `default_config` picks (TUNED,
else DEFAULT_TILES, 132 SMs) is recorded from `w4a16_gemm` on CPU tensors of the real shapes,
compiled by Triton for sm_90 with the launcher's own argument specialization (16-divisible
ints and pointers, ints equal to 1 as constants), and disassembled with the cuobjdump Triton
ships. The main loop is the longest backward branch's span; its SASS instruction count times
the warps' 32 lanes, over the weights one iteration covers, is the thread-instructions a weight
costs (x8: per packed int32). An H100 issues ~31e12 thread-instructions/s and int4 weights at
3 TB/s arrive at 6e12/s: above ~5 a weight the loop is issue-bound. "awq" has zeros (AWQ
repacked at load), "gptq" is symmetric as the GEMM benchmark's GPTQ weight is.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # as launches build; no warning

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanopaged.kernels import w4a16_gemm as mod  # noqa: E402
from nanopaged.kernels.w4a16_gemm import Int4Weight  # noqa: E402

SHAPES = {  # weight [N, K] of Qwen3-8B's projections
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (24576, 4096),
    "down_proj": (4096, 12288),
}
GROUP = 128
SM90_LANES = 32


class Recorder:
    """Stands in for a @triton.jit kernel: kernel[grid](...) records the launch, runs nothing."""

    def __init__(self, fn, launches: list):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.fn, grid, args, kwargs))


def record_launches(m: int, n: int, k: int, kind: str, config=None) -> list:
    """The kernel launches w4a16_gemm makes for x [m, k] and this [k, n] weight (CPU tensors)."""
    qweight = torch.zeros(k // 8, n, dtype=torch.int32)
    scales = torch.zeros(k // GROUP, n, dtype=torch.float16)
    qzeros = torch.zeros(k // GROUP, n // 8, dtype=torch.int32) if kind == "awq" else None
    w = Int4Weight(qweight, scales, qzeros, GROUP, None, 0 if kind == "awq" else 1)
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    config = config or mod.default_config(m, n, k, GROUP, num_sms=132)
    config = mod.resolve_split(config, m, n, k, 132)
    launches: list = []
    names = [name for name in dir(mod) if name.endswith("_kernel")]
    saved = {name: getattr(mod, name) for name in names}
    try:
        for name in names:
            setattr(mod, name, Recorder(saved[name], launches))
        mod.w4a16_gemm(x, w, config)
    finally:
        for name, fn in saved.items():
            setattr(mod, name, fn)
    return [(config, *launch) for launch in launches]


def compile_sm90(fn, args: tuple, kwargs: dict):
    """The launch compiled for sm_90 as the launcher's call would specialize it."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    params = fn.params
    values = dict(zip([p.name for p in params], args))
    values.update({key: v for key, v in kwargs.items() if key in values or key in
                   {p.name for p in params}})  # fmt: skip
    options = {key: v for key, v in kwargs.items() if key not in values}
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(params):
        value = values[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[(i,)] = "constexpr", value
            continue
        kind, attr = native_specialize_impl(BaseBackend, value, False, not p.do_not_specialize,
                                            not p.do_not_specialize_on_alignment)  # fmt: skip
        signature[p.name] = kind
        if kind == "constexpr":
            constexprs[(i,)] = attr
        elif attr == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def cuobjdump(cubin: bytes, flag: str) -> str:
    """The output of the cuobjdump Triton ships on a cubin."""
    tool = Path(__import__("triton").__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip


def sass_lines(cubin: bytes) -> list[str]:
    """The SASS of a cubin, one instruction a line: '/*addr*/ OP ...'."""
    out = cuobjdump(cubin, "-sass")
    return [line for line in out.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]


def registers(cubin: bytes) -> tuple[int, int]:
    """(registers a thread, stack bytes: spills) of a cubin's kernel."""
    out = cuobjdump(cubin, "-res-usage")
    reg, stack = re.search(r"REG:(\d+)", out), re.search(r"STACK:(\d+)", out)
    return int(reg.group(1)), int(stack.group(1)) if stack else 0


def main_loop(lines: list[str]) -> list[str]:
    """The instructions of the longest backward branch's span (the kernel's K loop)."""
    addr = [int(re.match(r"\s+/\*([0-9a-f]+)\*/", line).group(1), 16) for line in lines]
    best: list[str] = []
    for i, line in enumerate(lines):
        target = re.search(r"\bBRA\s+(0x[0-9a-f]+)", line)
        if target is None:
            continue
        to = int(target.group(1), 16)
        if to < addr[i]:
            span = [ln for ln, a in zip(lines, addr) if to <= a <= addr[i]]
            best = span if len(span) > len(best) else best
    return best


def opcode(line: str) -> str:
    body = re.sub(r"^\s+/\*[0-9a-f]+\*/\s+", "", line)
    body = re.sub(r"^@!?U?P\w+\s+", "", body)
    return body.split()[0].split(".")[0].rstrip(";")


def count(m: int, n: int, k: int, kind: str, dump: Path | None, cache: dict, config=None) -> dict:
    """The main kernel's loop count for one shape and row count (config: default_config's)."""
    config, fn, grid, args, kwargs = record_launches(m, n, k, kind, config)[0]
    key = (fn.__name__, tuple(sorted((a, str(v)) for a, v in kwargs.items())),
           tuple(native_key(a) for a in args))  # fmt: skip
    if key not in cache:
        compiled = compile_sm90(fn, args, kwargs)
        lines = sass_lines(compiled.asm["cubin"])
        if dump is not None:
            dump.mkdir(parents=True, exist_ok=True)
            (dump / f"{fn.__name__}_{len(cache)}.sass").write_text("\n".join(lines))
        cache[key] = (main_loop(lines), len(lines), *registers(compiled.asm["cubin"]))
    loop, total, regs, spills = cache[key]
    weights = config.block_k * config.block_n  # one loop iteration of one program
    per_weight = len(loop) * config.num_warps * SM90_LANES / weights
    # the whole program: code outside the loop once (every branch counted), the loop per step
    k_per_split = -(-k // (grid[2] * config.block_k)) * config.block_k
    steps = k_per_split // config.block_k
    program = (total - len(loop) + len(loop) * steps) * config.num_warps * SM90_LANES
    per_weight_program = program / (config.block_n * k_per_split)
    ops = Counter(opcode(line) for line in loop)
    return dict(kernel=fn.__name__, config=config, grid=grid, loop=len(loop),
                per_weight=per_weight, program=per_weight_program, regs=regs, spills=spills,
                ops=ops)  # fmt: skip


def native_key(value):
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), value.data_ptr() % 16 == 0)
    return value if not isinstance(value, int) else (value == 1, value % 16 == 0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--kinds", nargs="+", choices=["awq", "gptq"], default=["awq", "gptq"])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--dump", type=Path, default=None, help="write each kernel's SASS here")
    parser.add_argument("--ops", action="store_true", help="print the loop's opcode counts")
    parser.add_argument(
        "--config",
        default=None,
        help="count this launch instead of default_config's, e.g. "
        "'W4A16Config(16, 256, 128, split_k=8, num_warps=8, swap_ab=True)'",
    )
    args = parser.parse_args(argv)
    config = None if args.config is None else eval(args.config, {"W4A16Config": mod.W4A16Config})
    cache: dict = {}
    print(
        "shape          rows kind  kernel                 loop  instr/weight  /int32  program "
        " regs stack  launch"
    )
    for name in args.shapes:
        n, k = SHAPES[name]
        for m in args.rows:
            for kind in args.kinds:
                r = count(m, n, k, kind, args.dump, cache, config)
                c = r["config"]
                launch = (
                    f"{c.block_m}x{c.block_n}x{c.block_k} split {c.split_k} "
                    f"w{c.num_warps} s{c.num_stages}{' gemv' if c.gemv else ''}"
                    f"{' swap_ab' if c.swap_ab else ''}"
                )
                print(f"{name:14s} {m:4d} {kind:5s} {r['kernel']:22s} {r['loop']:5d} "
                      f"{r['per_weight']:12.2f} {8 * r['per_weight']:7.1f} {r['program']:8.2f} "
                      f"{r['regs']:5d} {r['spills']:5d}  {launch}", flush=True)  # fmt: skip
                if args.ops:
                    print("    " + ", ".join(f"{op} {c}" for op, c in r["ops"].most_common()))


if __name__ == "__main__":
    main()
