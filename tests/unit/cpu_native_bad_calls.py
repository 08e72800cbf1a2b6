"""Wrong calls of every ctypes entry point of kernels/cpu_native.py, one argument wrong at a
time, each with the exception it must raise before the C code runs. test_cpu_native.py runs
them; `python -O cpu_native_bad_calls.py` runs them with asserts stripped and exits 1 unless
every one raised and left its outputs untouched."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanopaged.kernels import cpu_native

BF16 = torch.bfloat16
ENTRIES = (
    "rms_norm", "rotate", "store_kv", "paged_decode", "rotary_decode", "silu_and_mul",
    "linear_row",
)  # fmt: skip
TOKENS, HEADS, KV_HEADS, DIM, BLOCKS, BLOCK_SIZE = 3, 4, 2, 64, 4, 16


def valid_args(entry: str) -> dict[str, object]:
    """Arguments a call of `entry` accepts: K/V non-zero, the caches zero (so a write shows)."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(TOKENS, (HEADS + 2 * KV_HEADS) * DIM, generator=gen).to(BF16)
    q = qkv[:, : HEADS * DIM].view(TOKENS, HEADS, DIM)
    k = qkv[:, HEADS * DIM : (HEADS + KV_HEADS) * DIM].view(TOKENS, KV_HEADS, DIM)
    v = qkv[:, (HEADS + KV_HEADS) * DIM :].view(TOKENS, KV_HEADS, DIM)
    caches = {
        name: torch.zeros(BLOCKS, BLOCK_SIZE, KV_HEADS, DIM, dtype=BF16)
        for name in ("k_cache", "v_cache")
    }
    tables = torch.arange(TOKENS, dtype=torch.int32).view(TOKENS, 1)
    decode = dict(
        block_tables=tables,
        context_lens=torch.full((TOKENS,), 5, dtype=torch.int32),
        scale=0.125,
        max_context_len=5,
    )
    if entry == "rms_norm":
        x = torch.randn(TOKENS, 32, generator=gen).to(BF16)
        return dict(x=x, weight=torch.ones(32, dtype=BF16), eps=1e-6, residual=x.clone())
    if entry == "silu_and_mul":
        return dict(x=torch.randn(TOKENS, 2 * 33, generator=gen))
    if entry == "linear_row":
        weight = torch.randn(7, 33, generator=gen)
        return dict(x=torch.randn(1, 33, generator=gen), weight=weight, bias=torch.ones(7))
    if entry == "rotate":
        table = torch.ones(TOKENS, 1, DIM, dtype=BF16)
        return dict(x=q, cos_t=table, signed_sin_t=table.clone())
    if entry == "store_kv":
        return dict(key=k, value=v, **caches, slot_mapping=torch.tensor([0, 17, -1]))
    if entry == "paged_decode":
        return dict(q=q, **caches, **decode)
    assert entry == "rotary_decode", entry
    table = torch.ones(64, DIM, dtype=torch.float32)
    return dict(
        q=q, k=k, v=v, positions=torch.tensor([4, 4, 4]), cos=table, sin=table.clone(), **caches,
        slot_mapping=torch.tensor([4, 20, -1]), **decode,
    )  # fmt: skip


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _strided_heads(t: torch.Tensor) -> torch.Tensor:
    """t's values with each token's heads apart in memory (head stride > head_dim)."""
    wide = torch.zeros(t.shape[0], t.shape[1], t.shape[2] + 8, dtype=t.dtype)
    wide[..., : t.shape[2]] = t
    return wide[..., : t.shape[2]]


@dataclass(frozen=True)
class BadCall:
    entry: str
    arg: str  # its name; several, comma-separated, take the same change
    bad: Callable[[object], object]  # the valid argument -> a wrong one
    error: type[Exception]
    match: str

    @property
    def id(self) -> str:
        return f"{self.entry}-{self.arg}-{self.match[:24]}"


def _cases() -> list[BadCall]:
    c = BadCall
    shared_decode = [
        c("{}", "q", lambda t: t.half(), TypeError, r"q must be torch.bfloat16 or torch.float32"),
        c("{}", "q", lambda t: t.float(), TypeError, r"k_cache must be torch.float32"),
        c("{}", "q", lambda t: t[..., :32], ValueError, r"k_cache's head_dim \(64\) must be q's"),
        c("{}", "q", lambda t: t[:, :3], ValueError, r"q's heads \(3\) must be a multiple"),
        c("{}", "q", lambda t: t.transpose(1, 2), ValueError, r"q's head rows must be contiguous"),
        c("{}", "q", _meta, ValueError, r"q must be a CPU tensor"),
        c("{}", "k_cache", lambda t: t[0], ValueError, r"k_cache must have 4 dimensions"),
        c("{}", "k_cache", lambda t: t.transpose(0, 1), ValueError, r"k_cache must be contiguous"),
        c("{}", "v_cache", lambda t: t[:2], ValueError, r"v_cache must have shape"),
        c("{}", "v_cache", lambda t: t.float(), TypeError, r"v_cache must be torch.bfloat16"),
        c("{}", "block_tables", lambda t: t.long(), TypeError, r"block_tables must be torch.int32"),
        c("{}", "block_tables", lambda t: t[:2], ValueError, r"block_tables must be \[batch=3"),
        c("{}", "block_tables", lambda t: t.repeat(1, 2).T.contiguous().T, ValueError,
          r"block_tables must be \[batch=3.*rows of stride 1"),  # fmt: skip
        c("{}", "block_tables", lambda t: t.flatten(), ValueError, r"block_tables must have 2"),
        c("{}", "context_lens", lambda t: t[:2], ValueError, r"context_lens must have shape"),
        c("{}", "context_lens", lambda t: t.long(), TypeError, r"context_lens must be torch.int32"),
        c("{}", "context_lens", lambda t: t.tolist(), TypeError, r"context_lens must be a torch"),
        c("{}", "scale", lambda s: "0.1", TypeError, r"scale must be a number"),
        c("{}", "max_context_len", lambda n: -1, ValueError, r"max_context_len must be >= 0"),
        c("{}", "max_context_len", lambda n: 5.0, TypeError, r"max_context_len must be an int"),
    ]
    cases = [
        c("rms_norm", "x", lambda t: t.half(), TypeError, r"x must be torch.bfloat16 or torch.f"),
        c("rms_norm", "x", lambda t: t.float(), TypeError, r"weight must be torch.float32"),
        c("rms_norm", "x", _meta, ValueError, r"x must be a CPU tensor"),
        c("rms_norm", "x", lambda t: t[0, 0], ValueError, r"x must have at least one dimension"),
        c("rms_norm", "weight", lambda t: t[:16], ValueError, r"weight must have shape \(32,\)"),
        c("rms_norm", "weight", lambda t: t.view(32, 1), ValueError, r"weight must have 1 dim"),
        c("rms_norm", "weight", lambda t: t.double(), TypeError, r"weight must be torch.bfloat16"),
        c("rms_norm", "residual", lambda t: t[:2], ValueError, r"residual must have shape"),
        c("rms_norm", "residual", lambda t: t.float(), TypeError, r"residual must be torch.bf"),
        c("rms_norm", "eps", lambda e: None, TypeError, r"eps must be a number"),
        c("silu_and_mul", "x", lambda t: t.to(BF16), TypeError, r"x must be torch.float32"),
        c("silu_and_mul", "x", lambda t: t[:, :65], ValueError, r"x's last dimension must be ev"),
        c("silu_and_mul", "x", lambda t: t[0, 0], ValueError, r"x's last dimension must be even"),
        c("silu_and_mul", "x", _meta, ValueError, r"x must be a CPU tensor"),
        c("linear_row", "x", lambda t: t.repeat(2, 1), ValueError, r"x must be one row \[1, 33\]"),
        c("linear_row", "x", lambda t: t[:, :32], ValueError, r"x must be one row \[1, 33\]"),
        c("linear_row", "x", lambda t: t.double(), TypeError, r"x must be torch.float32"),
        c("linear_row", "x", lambda t: t.view(33), ValueError, r"x must have 2 dimensions"),
        c("linear_row", "x", _meta, ValueError, r"x must be a CPU tensor"),
        c("linear_row", "weight", lambda t: t.T.contiguous().T, ValueError,
          r"weight's rows must be of stride 1"),  # fmt: skip
        c("linear_row", "weight", lambda t: t.to(BF16), TypeError, r"weight must be torch.fl"),
        c("linear_row", "bias", lambda t: t[:6], ValueError, r"bias must have shape \(7,\)"),
        c("linear_row", "bias", lambda t: t.repeat(2)[::2], ValueError, r"bias must be contig"),
        c("linear_row", "bias", lambda t: t.double(), TypeError, r"bias must be torch.float32"),
        c("rotate", "x", lambda t: t[0], ValueError, r"x must have 3 dimensions"),
        c("rotate", "x", lambda t: t[..., :63], ValueError, r"x must have an even last dim"),
        c("rotate", "x", lambda t: t.transpose(1, 2), ValueError, r"x must have an even last"),
        c("rotate", "cos_t", lambda t: t[:2], ValueError, r"cos_t must have shape \(3, 1, 64\)"),
        c("rotate", "cos_t", lambda t: t.float(), TypeError, r"cos_t must be torch.bfloat16"),
        c("rotate", "signed_sin_t", lambda t: t.repeat(1, 1, 2)[..., ::2], ValueError,
          r"signed_sin_t must be contiguous"),  # fmt: skip
        # The call that read past value's memory: fewer value tokens than key tokens.
        c("store_kv", "value", lambda t: t[:2], ValueError, r"value must have shape \(3, 2, 64\)"),
        c("store_kv", "value", lambda t: t[:, :1], ValueError, r"value must have shape"),
        c("store_kv", "value", lambda t: t.float(), TypeError, r"value must be torch.bfloat16"),
        c("store_kv", "value", _strided_heads, ValueError, r"value must hold each token's heads"),
        c("store_kv", "key", _strided_heads, ValueError, r"key must hold each token's heads"),
        c("store_kv", "key", lambda t: t[0], ValueError, r"key must have 3 dimensions"),
        c("store_kv", "key,value", lambda t: t[:, :1], ValueError,
          r"k_cache's last two dimensions must be key's .* = \(1, 64\)"),  # fmt: skip
        c("store_kv", "key", _meta, ValueError, r"key must be a CPU tensor"),
        c("store_kv", "k_cache", lambda t: t[..., :32].contiguous(), ValueError,
          r"v_cache must have shape"),  # fmt: skip
        c("store_kv", "k_cache", lambda t: t.transpose(0, 1), ValueError, r"k_cache must be cont"),
        c("store_kv", "v_cache", lambda t: t[:, :, :1].contiguous(), ValueError,
          r"v_cache must have shape"),  # fmt: skip
        c("store_kv", "slot_mapping", lambda t: t.int(), TypeError, r"slot_mapping must be torch"),
        c("store_kv", "slot_mapping", lambda t: t[:2], ValueError, r"slot_mapping must have shape"),
        c("store_kv", "slot_mapping", lambda t: t.repeat(2)[::2], ValueError,
          r"slot_mapping must be contiguous"),  # fmt: skip
        c("store_kv", "slot_mapping", lambda t: t.tolist(), TypeError, r"slot_mapping must be a"),
        c("rotary_decode", "k", lambda t: t[:2], ValueError, r"k must have shape \(3, 2, 64\)"),
        c("rotary_decode", "v", lambda t: t[:2], ValueError, r"v must have shape \(3, 2, 64\)"),
        c("rotary_decode", "v", lambda t: t.float(), TypeError, r"v must be torch.bfloat16"),
        c("rotary_decode", "k", lambda t: t.transpose(1, 2).contiguous().transpose(1, 2),
          ValueError, r"k's head rows must be contiguous"),  # fmt: skip
        c("rotary_decode", "cos", lambda t: t[:, :32], ValueError, r"cos must be \[max_position"),
        c("rotary_decode", "cos", lambda t: t.to(BF16), TypeError, r"cos must be torch.float32"),
        c("rotary_decode", "sin", lambda t: t[:32], ValueError, r"sin must have shape \(64, 64\)"),
        c("rotary_decode", "sin", lambda t: t.T.contiguous().T, ValueError, r"sin must be cont"),
        c("rotary_decode", "positions", lambda t: t[:1], ValueError, r"positions must have shape"),
        c("rotary_decode", "positions", lambda t: t.int(), TypeError, r"positions must be torch"),
        c("rotary_decode", "slot_mapping", lambda t: t.int(), TypeError, r"slot_mapping must be"),
        c("rotary_decode", "slot_mapping", lambda t: t[:2], ValueError, r"slot_mapping must have"),
    ]
    for entry in ("paged_decode", "rotary_decode"):
        cases += [BadCall(entry, s.arg, s.bad, s.error, s.match) for s in shared_decode]
    return cases


CASES = _cases()


def call(case: BadCall) -> tuple[Exception | None, bool]:
    """Run the wrong call: (the exception it raised or None, whether its outputs stayed
    untouched: the caches of the calls that write into them)."""
    args = valid_args(case.entry)
    changed = case.arg.split(",")
    for name in changed:
        args[name] = case.bad(args[name])
    outputs = [args[n] for n in ("k_cache", "v_cache") if n in args and n not in changed]
    before = [t.clone() for t in outputs]
    try:
        getattr(cpu_native, case.entry)(**args)
    except Exception as e:  # noqa: BLE001 - the caller judges which one it is
        raised: Exception | None = e
    else:
        raised = None
    untouched = all(torch.equal(a, b) for a, b in zip(outputs, before))
    return raised, untouched


def check(case: BadCall) -> str | None:
    """None when the wrong call raised case.error matching case.match and wrote nothing; else
    what went wrong (no assert: this also runs under `python -O`)."""
    raised, untouched = call(case)
    if not isinstance(raised, case.error) or not re.search(case.match, str(raised)):
        return f"{case.id}: expected {case.error.__name__}({case.match!r}), got {raised!r}"
    if not untouched:
        return f"{case.id}: the caches were written"
    return None


def main() -> int:
    if not cpu_native.available():
        print("CPU kernels unavailable")
        return 2
    failures = [f for f in map(check, CASES) if f is not None]
    print("\n".join(failures) or f"all {len(CASES)} wrong calls raised")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
