"""CPU kernels in C for bfloat16 models (cpu_native.c), called through ctypes.

On a CPU, a decode step of a small model is mostly torch's per-op cost around the GEMMs: an
RMSNorm is nine ops, attention a gather, a fill and an SDPA call, each paying dispatch and an
allocation on data that a GEMM just evicted from the caches. These kernels do each op in one
pass. The source is compiled once per machine with its C compiler (`$CC`, else `cc`/`gcc`)
into nanopaged's cache directory (`$NANOPAGED_CACHE`, else `~/.cache/nanopaged`), keyed by a
hash of the source, the flags and the CPU; a process compiles at most once. Without a
compiler, or with `NANOPAGED_CPU_KERNELS=0`, `load()` returns None and the CPU runs the torch
references. Each function here has its reference beside its Triton kernel (the tests compare
the two); fp32 models never come here, they run the references, bit for bit HF's arithmetic.
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
        checked = name in ("np_paged_decode", "np_rotary_decode", "np_store_kv")
        fn.restype = ctypes.c_int if checked else None
    return lib


def available() -> bool:
    return load() is not None


def _lib() -> ctypes.CDLL:
    lib = load()
    assert lib is not None, "CPU kernels unavailable: check cpu_native.available() first"
    return lib


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as rows of its last dimension, each row contiguous (x itself when it already is)."""
    if x.dim() == 2 and x.stride(1) == 1:
        return x
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _check_bf16(*tensors: torch.Tensor) -> None:
    for t in tensors:
        assert t.dtype is torch.bfloat16 and not t.is_cuda, (t.dtype, t.device)


# The wrappers run once per layer and step: each check and allocation here is a visible share
# of a decode step at small batches (the kernels themselves take a few µs there).


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """rms_norm_ref's result (see kernels/rms_norm.py): out, or (out, x + residual)."""
    xr = _rows(x)
    rows, hidden = xr.shape
    _check_bf16(xr, weight)
    assert weight.stride(0) == 1 and weight.shape[0] == hidden, weight.shape
    out = torch.empty((rows, hidden), dtype=torch.bfloat16)
    if residual is None:
        _lib().np_rms_norm(
            xr.data_ptr(), xr.stride(0), None, 0, weight.data_ptr(), out.data_ptr(), hidden,
            None, 0, rows, hidden, eps,
        )  # fmt: skip
        return out if xr is x else out.view(x.shape)
    rr = _rows(residual)
    _check_bf16(rr)
    assert rr.shape == xr.shape, (rr.shape, xr.shape)
    new_residual = torch.empty_like(out)
    _lib().np_rms_norm(
        xr.data_ptr(), xr.stride(0), rr.data_ptr(), rr.stride(0), weight.data_ptr(),
        out.data_ptr(), hidden, new_residual.data_ptr(), hidden, rows, hidden, eps,
    )  # fmt: skip
    if xr is x:
        return out, new_residual
    return out.view(x.shape), new_residual.view(x.shape)


def rotate(x: torch.Tensor, cos_t: torch.Tensor, signed_sin_t: torch.Tensor) -> torch.Tensor:
    """rotate_ref's result, bit for bit: x [tokens, heads, dim] (each head's row contiguous),
    the tables [tokens, 1, dim] from rotary_tables_ref; a new contiguous tensor."""
    tokens, heads, dim = x.shape
    _check_bf16(x, cos_t, signed_sin_t)
    assert x.stride(2) == 1 and dim % 2 == 0, (x.stride(), dim)
    assert cos_t.shape == signed_sin_t.shape == (tokens, 1, dim), (cos_t.shape, x.shape)
    assert cos_t.is_contiguous() and signed_sin_t.is_contiguous()
    out = torch.empty((tokens, heads, dim), dtype=torch.bfloat16)
    _lib().np_rotate(
        x.data_ptr(), x.stride(0), x.stride(1), cos_t.data_ptr(), signed_sin_t.data_ptr(), dim,
        out.data_ptr(), tokens, heads, dim,
    )  # fmt: skip
    return out


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """store_kv_ref for a bf16 cache: key/value [tokens, kv_heads, dim] into their slots (-1
    skips). Each token's heads must lie contiguously (a view of a qkv row does)."""
    tokens, kv_heads, dim = key.shape
    _check_bf16(key, value, k_cache, v_cache)
    assert key.stride()[1:] == value.stride()[1:] == (dim, 1), (key.stride(), value.stride())
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.shape[-2:] == (kv_heads, dim) and v_cache.shape == k_cache.shape
    assert slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
    assert slot_mapping.shape == (tokens,), (slot_mapping.shape, tokens)
    row = kv_heads * dim
    status = _lib().np_store_kv(
        key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(),
        v_cache.data_ptr(), slot_mapping.data_ptr(), tokens, row, k_cache.numel() // row,
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"slot_mapping holds a slot outside [-1, {k_cache.numel() // row})")


def _check_decode(q, k_cache, v_cache, block_tables, context_lens) -> None:
    batch, heads, dim = q.shape
    _check_bf16(q, k_cache, v_cache)
    kv_heads, cache_dim = k_cache.shape[2:]
    assert cache_dim == dim and heads % kv_heads == 0 and q.stride(2) == 1, (q.shape, k_cache.shape)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape
    assert block_tables.dtype is torch.int32 and context_lens.dtype is torch.int32
    assert block_tables.stride(1) == 1 and context_lens.is_contiguous()
    assert block_tables.shape[0] == context_lens.shape[0] == batch


def _decode_status(status: int, max_context_len: int) -> None:
    if status == -1:
        raise ValueError(f"max_context_len={max_context_len} is below a context length")
    if status == -2:
        raise ValueError("block_tables do not cover context_lens with blocks of the cache")
    if status == -3:
        raise ValueError("a position is outside the rotary tables or a slot outside the cache")
    assert status == 0, status


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int,
) -> torch.Tensor:
    """paged_decode_ref for a bf16 cache, in fp32 arithmetic (probabilities not rounded to
    bf16 before the sum over V). q [batch, heads, dim]; max_context_len >= every context."""
    _check_decode(q, k_cache, v_cache, block_tables, context_lens)
    batch, heads, dim = q.shape
    num_blocks, block_size, kv_heads = k_cache.shape[:3]
    scratch = torch.empty(
        heads // kv_heads * (max_context_len + 2 * dim) + dim, dtype=torch.float32
    )
    out = torch.empty((batch, heads, dim), dtype=torch.bfloat16)
    status = _lib().np_paged_decode(
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
    contiguous); positions and slot_mapping int64, one per sequence."""
    _check_decode(q, k_cache, v_cache, block_tables, context_lens)
    batch, heads, dim = q.shape
    num_blocks, block_size, kv_heads = k_cache.shape[:3]
    _check_bf16(k, v)
    assert k.shape == v.shape == (batch, kv_heads, dim), (k.shape, v.shape, q.shape)
    assert k.stride(2) == 1 and v.stride(2) == 1 and dim % 2 == 0, (k.stride(), v.stride())
    assert cos.dtype is sin.dtype is torch.float32 and cos.shape == sin.shape
    assert cos.is_contiguous() and sin.is_contiguous() and cos.shape[1] == dim, cos.shape
    for t in (positions, slot_mapping):
        assert t.dtype is torch.int64 and t.is_contiguous() and t.shape == (batch,), t.shape
    scratch = torch.empty(
        heads // kv_heads * (max_context_len + 2 * dim) + dim + (heads + 1) * dim,
        dtype=torch.float32,
    )  # fmt: skip
    out = torch.empty((batch, heads, dim), dtype=torch.bfloat16)
    status = _lib().np_rotary_decode(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
        v.data_ptr(), v.stride(0), v.stride(1), positions.data_ptr(), cos.data_ptr(),
        sin.data_ptr(), cos.shape[0], slot_mapping.data_ptr(), k_cache.data_ptr(),
        v_cache.data_ptr(), num_blocks, block_tables.data_ptr(), block_tables.stride(0),
        block_tables.shape[1], context_lens.data_ptr(), batch, heads, kv_heads, dim,
        block_size, scale, scratch.data_ptr(), scratch.numel(), out.data_ptr(),
    )  # fmt: skip
    _decode_status(status, max_context_len)
    return out
