"""CPU kernels in C (cpu_native.c), called through ctypes: for bfloat16 models, and for fp32
models decode attention (with rotary and the KV store), the norms, SiLU and one-row GEMMs.

On a CPU, a decode step of a small model is mostly torch's per-op cost around the GEMMs: an
RMSNorm is nine ops, attention a gather, a fill and an SDPA call, each paying dispatch and an
allocation on data that a GEMM just evicted from the caches. These kernels do each op in one
pass. The source is compiled once per machine with its C compiler (`$CC`, else `cc`/`gcc`)
into nanopaged's cache directory (`$NANOPAGED_CACHE`, else `~/.cache/nanopaged`), keyed by a
hash of the source, the flags and the CPU; a process compiles at most once. Without a
compiler, or with `NANOPAGED_CPU_KERNELS=0`, `load()` returns None and the CPU runs the torch
references. Each function here has its reference beside its Triton kernel (the tests compare
the two). In fp32 rotary and the store are bit for bit their references; attention, the norm's
sum of squares and the GEMV add in another order (within fp32 rounding), and SiLU's exp is
within ~2 ulp of torch's.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from nanopaged.gguf import cache_root

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_native.c")
FLAGS = [
    "-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp-simd", "-fno-math-errno",
    "-fno-trapping-math", "-ffp-contract=fast", "-std=c11", "-shared", "-fPIC",
]  # fmt: skip
_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
_SIGNATURES = {
    "np_rms_norm": [_P, _I, _P, _I, _P, _P, _I, _P, _I, _I, _I, _F],
    "np_rotate": [_P, _I, _I, _P, _P, _I, _P, _I, _I, _I],
    "np_store_kv": [_P, _I, _P, _I, _P, _P, _P, _I, _I, _I],
    "np_paged_decode": [_P, _I, _I, _P, _P, _I, _P, _I, _I, _P, _I, _I, _I, _I, _I, _F, _P, _I, _P],
    "np_rotary_decode": [
        _P, _I, _I, _P, _I, _I, _P, _I, _I, _P, _P, _P, _I, _P, _P, _P, _I, _P, _I, _I, _P,
        _I, _I, _I, _I, _I, _F, _P, _I, _P,
    ],
}
_SIGNATURES["np_rms_norm_f32"] = _SIGNATURES["np_rms_norm"]
_SIGNATURES["np_silu_mul_f32"] = [_P, _I, _P, _I, _I, _I]
_SIGNATURES["np_gemv_f32"] = [_P, _P, _I, _P, _P, _I, _I]
_SIGNATURES["np_paged_decode_f32"] = _SIGNATURES["np_paged_decode"]
_SIGNATURES["np_rotary_decode_f32"] = _SIGNATURES["np_rotary_decode"]
# Decode attention's dtypes, and the suffix of their entry points
_DECODE_SUFFIX = {torch.bfloat16: "", torch.float32: "_f32"}


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_key() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(lines[:2])


def _build(compiler: str) -> Path:
    """The compiled library's path, compiling it first when this machine has none yet."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=True
    ).stdout
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_key()]).encode()
    ).hexdigest()[:16]
    target = cache_root() / f"cpu_native-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Compiled beside the target under a temporary name, then renamed: processes compiling at
    # once each rename a whole library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, "-o", tmp, str(SOURCE), "-lm"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernels' library, or None (disabled, no compiler, or the build failed: logged)."""
    if os.environ.get("NANOPAGED_CPU_KERNELS", "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        logger.info("no C compiler found: the CPU runs the torch references")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("CPU kernels not built, the CPU runs the torch references: %s", detail)
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        checked = name.startswith(("np_paged_decode", "np_rotary_decode", "np_store_kv"))
        fn.restype = ctypes.c_int if checked else None
    return lib


def available() -> bool:
    return load() is not None


def _lib() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError("CPU kernels unavailable: check cpu_native.available() first")
    return lib


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as rows of its last dimension, each row contiguous (x itself when it already is)."""
    if x.dim() == 2 and x.stride(1) == 1:
        return x
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


# The C code reads and writes memory through every pointer, size and stride it is given, so
# each requirement is checked here with a real exception (never an assert, which `python -O`
# strips): a wrong call is an error, not a crash or a write outside a tensor.
def _tensor(name: str, t: object, dtype: torch.dtype, ndim: int | None = None) -> None:
    """TypeError unless t is a tensor of dtype; ValueError unless it lies in CPU memory (a meta
    tensor has no data) with ndim dimensions."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if not t.is_cpu:  # (is_cpu: a flag read; t.device builds an object, on every call)
        raise ValueError(f"{name} must be a CPU tensor, got device {t.device}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")


def _shape(name: str, t: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} ({what}), got {tuple(t.shape)}")


def _contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def _caches(
    k_cache: object, v_cache: object, dtype: torch.dtype = torch.bfloat16
) -> tuple[int, int, int, int]:
    """(num_blocks, block_size, kv_heads, head_dim) of two caches of dtype [num_blocks,
    block_size, kv_heads, head_dim], contiguous and alike; ValueError or TypeError naming the
    one that is not."""
    _tensor("k_cache", k_cache, dtype, 4)
    _tensor("v_cache", v_cache, dtype, 4)
    _contiguous("k_cache", k_cache)
    _contiguous("v_cache", v_cache)
    shape = tuple(k_cache.shape)
    _shape("v_cache", v_cache, shape, "k_cache's")
    if min(shape[1:]) < 1:
        raise ValueError(f"k_cache's block_size, kv_heads and head_dim must be >= 1, got {shape}")
    return shape


# The wrappers run once per layer and step: each check and allocation here is a visible share
# of a decode step at small batches (the kernels themselves take a few µs there).


_NORM_SUFFIX = {torch.bfloat16: "", torch.float32: "_f32"}


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """rms_norm_ref's result (see kernels/rms_norm.py) for bf16 or fp32 x, weight and residual
    (one dtype): out, or (out, x + residual)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    dtype = x.dtype
    if dtype not in _NORM_SUFFIX:
        raise TypeError(f"x must be torch.bfloat16 or torch.float32, got {dtype}")
    _tensor("x", x, dtype)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the hidden size), got a scalar")
    _tensor("weight", weight, dtype, 1)
    _shape("weight", weight, (x.shape[-1],), "x's last dimension")
    _contiguous("weight", weight)
    eps = _number("eps", eps)
    fn = getattr(_lib(), "np_rms_norm" + _NORM_SUFFIX[dtype])
    xr = _rows(x)
    rows, hidden = xr.shape
    out = torch.empty((rows, hidden), dtype=dtype)
    if residual is None:
        fn(
            xr.data_ptr(), xr.stride(0), None, 0, weight.data_ptr(), out.data_ptr(), hidden,
            None, 0, rows, hidden, eps,
        )  # fmt: skip
        return out if xr is x else out.view(x.shape)
    _tensor("residual", residual, dtype)
    _shape("residual", residual, tuple(x.shape), "x's")
    rr = _rows(residual)
    new_residual = torch.empty_like(out)
    fn(
        xr.data_ptr(), xr.stride(0), rr.data_ptr(), rr.stride(0), weight.data_ptr(),
        out.data_ptr(), hidden, new_residual.data_ptr(), hidden, rows, hidden, eps,
    )  # fmt: skip
    if xr is x:
        return out, new_residual
    return out.view(x.shape), new_residual.view(x.shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu_and_mul_ref's result for fp32 x [..., 2 * d] (exp within ~2 ulp of torch's): a new
    contiguous [..., d]."""
    _tensor("x", x, torch.float32)
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x's last dimension must be even ([..., 2 * d]), got {tuple(x.shape)}")
    xr = _rows(x)
    rows, d = xr.shape[0], xr.shape[1] // 2
    out = torch.empty((rows, d), dtype=torch.float32)
    _lib().np_silu_mul_f32(xr.data_ptr(), xr.stride(0), out.data_ptr(), d, rows, d)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], d)


def linear_row(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias) for one fp32 row x [1, in] (its sums in another order, within
    fp32 rounding): weight [out, in] with rows of stride 1, bias None or [out]; [1, out]."""
    _tensor("x", x, torch.float32, 2)
    _tensor("weight", weight, torch.float32, 2)
    n, k = weight.shape
    if x.shape != (1, k) or x.stride(1) != 1:
        raise ValueError(f"x must be one row [1, {k}] of stride 1 (weight's in), got shape "
                         f"{tuple(x.shape)}, strides {x.stride()}")  # fmt: skip
    if weight.stride(1) != 1 or weight.stride(0) < k:
        raise ValueError(f"weight's rows must be of stride 1 and at least {k} apart, got "
                         f"strides {weight.stride()}")  # fmt: skip
    if bias is not None:
        _index_vector("bias", bias, torch.float32, n, "one per row of weight")
    out = torch.empty((1, n), dtype=torch.float32)
    _lib().np_gemv_f32(
        x.data_ptr(), weight.data_ptr(), weight.stride(0),
        None if bias is None else bias.data_ptr(), out.data_ptr(), n, k,
    )  # fmt: skip
    return out


def rotate(x: torch.Tensor, cos_t: torch.Tensor, signed_sin_t: torch.Tensor) -> torch.Tensor:
    """rotate_ref's result, bit for bit: x [tokens, heads, dim] (each head's row contiguous),
    the tables [tokens, 1, dim] from rotary_tables_ref; a new contiguous tensor."""
    _tensor("x", x, torch.bfloat16, 3)
    tokens, heads, dim = x.shape
    if x.stride(2) != 1 or dim % 2:
        raise ValueError(
            "x must have an even last dimension of stride 1 (each head's row contiguous), "
            f"got shape {tuple(x.shape)}, strides {x.stride()}"
        )
    for name, table in (("cos_t", cos_t), ("signed_sin_t", signed_sin_t)):
        _tensor(name, table, torch.bfloat16, 3)
        _shape(name, table, (tokens, 1, dim), "[tokens, 1, head_dim] of x")
        _contiguous(name, table)
    out = torch.empty((tokens, heads, dim), dtype=torch.bfloat16)
    _lib().np_rotate(
        x.data_ptr(), x.stride(0), x.stride(1), cos_t.data_ptr(), signed_sin_t.data_ptr(), dim,
        out.data_ptr(), tokens, heads, dim,
    )  # fmt: skip
    return out


def _heads_rows(name: str, t: object, shape: tuple[int, int, int] | None = None) -> None:
    """t: bf16 [tokens, kv_heads, dim] (of `shape` when given) whose tokens each hold their
    heads' rows one after another (a view of a qkv row does)."""
    _tensor(name, t, torch.bfloat16, 3)
    if shape is not None:
        _shape(name, t, shape, "[tokens, kv_heads, head_dim] of key")
    if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        raise ValueError(f"{name} must hold each token's heads contiguously (strides (*, "
                         f"{t.shape[2]}, 1)), got strides {t.stride()}")  # fmt: skip


def _index_vector(name: str, t: object, dtype: torch.dtype, length: int, what: str) -> None:
    _tensor(name, t, dtype, 1)
    _shape(name, t, (length,), what)
    _contiguous(name, t)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """store_kv_ref for a bf16 cache: key/value [tokens, kv_heads, dim] into their slots (-1
    skips). Each token's heads must lie contiguously (a view of a qkv row does)."""
    _heads_rows("key", key)
    tokens, kv_heads, dim = key.shape
    _heads_rows("value", value, (tokens, kv_heads, dim))
    cache_shape = _caches(k_cache, v_cache)
    if cache_shape[2:] != (kv_heads, dim):
        raise ValueError(f"k_cache's last two dimensions must be key's (kv_heads, head_dim) = "
                         f"{(kv_heads, dim)}, got shape {cache_shape}")  # fmt: skip
    _index_vector("slot_mapping", slot_mapping, torch.int64, tokens, "one slot per token of key")
    row = kv_heads * dim
    status = _lib().np_store_kv(
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(),
        v_cache.data_ptr(), slot_mapping.data_ptr(), tokens, row, k_cache.numel() // row,
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"slot_mapping holds a slot outside [-1, {k_cache.numel() // row})")


def _check_decode(
    q: object,
    k_cache: object,
    v_cache: object,
    block_tables: object,
    context_lens: object,
    scale: object,
    max_context_len: object,
) -> float:
    """The checks paged_decode and rotary_decode share; returns scale as a float."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype not in _DECODE_SUFFIX:
        raise TypeError(f"q must be torch.bfloat16 or torch.float32, got {q.dtype}")
    _tensor("q", q, q.dtype, 3)
    batch, heads, dim = q.shape
    if q.stride(2) != 1:
        raise ValueError(f"q's head rows must be contiguous (last stride 1), got {q.stride()}")
    _, _, kv_heads, cache_dim = _caches(k_cache, v_cache, q.dtype)
    if cache_dim != dim:
        raise ValueError(f"k_cache's head_dim ({cache_dim}) must be q's ({dim})")
    if heads % kv_heads:
        raise ValueError(f"q's heads ({heads}) must be a multiple of k_cache's kv_heads "
                         f"({kv_heads})")  # fmt: skip
    _tensor("block_tables", block_tables, torch.int32, 2)
    if block_tables.shape[0] != batch or block_tables.stride(1) != 1:
        raise ValueError(
            f"block_tables must be [batch={batch}, *] with rows of stride 1, got shape "
            f"{tuple(block_tables.shape)}, strides {block_tables.stride()}"
        )
    _index_vector("context_lens", context_lens, torch.int32, batch, "one per sequence of q")
    scale = _number("scale", scale)
    if isinstance(max_context_len, bool) or not isinstance(max_context_len, int):
        raise TypeError(f"max_context_len must be an int, got {type(max_context_len).__name__}")
    if max_context_len < 0:
        raise ValueError(f"max_context_len must be >= 0, got {max_context_len}")
    return scale


def _decode_status(status: int, max_context_len: int) -> None:
    if status == -1:
        raise ValueError(f"max_context_len={max_context_len} is below a context length")
    if status == -2:
        raise ValueError("block_tables do not cover context_lens with blocks of the cache")
    if status == -3:
        raise ValueError("a position is outside the rotary tables or a slot outside the cache")
    if status != 0:
        raise RuntimeError(f"CPU decode kernel returned unknown status {status}")


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int,
) -> torch.Tensor:
    """paged_decode_ref for a bf16 or fp32 cache (q's dtype), in fp32 arithmetic (a bf16
    cache's probabilities not rounded to bf16 before the sum over V). q [batch, heads, dim];
    max_context_len >= every context."""
    scale = _check_decode(q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len)
    batch, heads, dim = q.shape
    num_blocks, block_size, kv_heads = k_cache.shape[:3]
    scratch = torch.empty(
        heads // kv_heads * (max_context_len + 2 * dim) + dim, dtype=torch.float32
    )
    out = torch.empty((batch, heads, dim), dtype=q.dtype)
    status = getattr(_lib(), "np_paged_decode" + _DECODE_SUFFIX[q.dtype])(
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
        num_blocks, block_tables.data_ptr(), block_tables.stride(0), block_tables.shape[1],
        context_lens.data_ptr(), batch, heads, kv_heads, dim, block_size, scale,
        scratch.data_ptr(), scratch.numel(), out.data_ptr(),
    )  # fmt: skip
    _decode_status(status, max_context_len)
    return out


def rotary_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int,
) -> torch.Tensor:
    """A decode step's attention after the qkv projection, in one call: rotate q and k at
    positions (rotate_ref's result with rotary_tables_ref's tables from cos/sin [positions,
    dim] fp32), store k and v at slot_mapping (store_kv_ref), then paged_decode. q [batch,
    heads, dim], k and v [batch, kv_heads, dim] (views of the qkv rows: each head's row
    contiguous), all bf16 or all fp32; positions and slot_mapping int64, one per sequence."""
    scale = _check_decode(q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len)
    batch, heads, dim = q.shape
    num_blocks, block_size, kv_heads = k_cache.shape[:3]
    if dim % 2:
        raise ValueError(f"q's head_dim must be even for the rotation, got {dim}")
    for name, t in (("k", k), ("v", v)):
        _tensor(name, t, q.dtype, 3)
        _shape(name, t, (batch, kv_heads, dim), "[batch, kv_heads, head_dim] of q and k_cache")
        if t.stride(2) != 1:
            raise ValueError(f"{name}'s head rows must be contiguous (last stride 1), got "
                             f"{t.stride()}")  # fmt: skip
    _tensor("cos", cos, torch.float32, 2)
    _tensor("sin", sin, torch.float32, 2)
    if cos.shape[1] != dim:
        raise ValueError(f"cos must be [max_position, head_dim={dim}], got {tuple(cos.shape)}")
    _shape("sin", sin, tuple(cos.shape), "cos's")
    _contiguous("cos", cos)
    _contiguous("sin", sin)
    _index_vector("positions", positions, torch.int64, batch, "one per sequence of q")
    _index_vector("slot_mapping", slot_mapping, torch.int64, batch, "one per sequence of q")
    scratch = torch.empty(
        heads // kv_heads * (max_context_len + 2 * dim) + dim + (heads + 3) * dim,
        dtype=torch.float32,
    )  # fmt: skip
    out = torch.empty((batch, heads, dim), dtype=q.dtype)
    status = getattr(_lib(), "np_rotary_decode" + _DECODE_SUFFIX[q.dtype])(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
        v.data_ptr(), v.stride(0), v.stride(1), positions.data_ptr(), cos.data_ptr(),
        sin.data_ptr(), cos.shape[0], slot_mapping.data_ptr(), k_cache.data_ptr(),
        v_cache.data_ptr(), num_blocks, block_tables.data_ptr(), block_tables.stride(0),
        block_tables.shape[1], context_lens.data_ptr(), batch, heads, kv_heads, dim,
        block_size, scale, scratch.data_ptr(), scratch.numel(), out.data_ptr(),
    )  # fmt: skip
    _decode_status(status, max_context_len)
    return out
