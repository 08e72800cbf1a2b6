"""The C kernels a bfloat16 model runs on CPU (kernels/cpu_native.c) against their torch
references: rotary and the KV store bit for bit, the norm and decode attention to bf16
rounding; the build, its opt-out, and the backend that picks them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cpu_native_bad_calls import CASES, ENTRIES, check, valid_args
from tiny_models import make_tiny_model

from nanopaged import LLM, SamplingParams
from nanopaged.attention import CpuNativeAttention, TorchAttention, attention_backend
from nanopaged.kernels import cpu_native
from nanopaged.kernels.paged_decode import paged_decode_ref
from nanopaged.kernels.rms_norm import rms_norm_ref
from nanopaged.kernels.rotary import rotary_tables_ref, rotate_ref
from nanopaged.kernels.store_kv import store_kv_ref
from nanopaged.layers.backend import CPU_NATIVE, TORCH
from nanopaged.layers.rotary import RotaryEmbedding

BF16 = torch.bfloat16
needs_kernels = pytest.mark.skipif(
    cpu_native._compiler() is None, reason="no C compiler on this machine"
)


def rand(*shape, seed, scale=1.0, dtype=BF16):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


@needs_kernels
def test_builds_once_into_the_cache(monkeypatch, tmp_path):
    assert cpu_native.available()
    monkeypatch.setenv("NANOPAGED_CACHE", str(tmp_path))
    cpu_native.load.cache_clear()
    try:
        lib = cpu_native.load()
        assert lib is not None
        built = list(tmp_path.glob("cpu_native-*.so"))
        assert len(built) == 1
        mtime = built[0].stat().st_mtime_ns
        cpu_native.load.cache_clear()
        assert cpu_native.load() is not None  # found, not compiled again
        assert built[0].stat().st_mtime_ns == mtime
        assert list(tmp_path.glob("*")) == built  # no temporary file left behind
    finally:
        cpu_native.load.cache_clear()


@needs_kernels
def test_backend_choice_and_opt_out(monkeypatch):
    native = attention_backend("cpu", BF16)
    assert type(native) is CpuNativeAttention and native.ops is CPU_NATIVE
    fp32 = attention_backend("cpu", torch.float32)  # C decode, norms, SiLU, one-row GEMMs
    assert type(fp32) is CpuNativeAttention
    for dtype in (torch.float16, None):
        backend = attention_backend("cpu", dtype)
        assert type(backend) is TorchAttention and backend.ops is TORCH
    monkeypatch.setenv("NANOPAGED_CPU_KERNELS", "0")
    cpu_native.load.cache_clear()
    try:
        assert cpu_native.load() is None
        assert type(attention_backend("cpu", BF16)) is TorchAttention
    finally:
        cpu_native.load.cache_clear()


@needs_kernels
@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("hidden", [576, 100, 64])
def test_rms_norm_matches_reference(rows, hidden):
    # x is a strided view (rows of a wider buffer), as a slice of a projection output is.
    x = rand(rows, hidden + 8, seed=rows + hidden, scale=3.0)[:, :hidden]
    residual = rand(rows, hidden, seed=7, scale=3.0)
    weight = rand(hidden, seed=8) + 1.0
    expected = rms_norm_ref(x, weight, 1e-5)
    out = cpu_native.rms_norm(x, weight, 1e-5)
    # The sum of squares adds in another order than torch's: at most one bf16 step apart,
    # almost always equal.
    ulp = expected.float().abs().clamp_min(1e-30) * 2.0**-7
    assert ((out.float() - expected.float()).abs() <= ulp).all()
    assert (out == expected).float().mean() > 0.99
    exp_out, exp_res = rms_norm_ref(x, weight, 1e-5, residual)
    got_out, got_res = cpu_native.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(got_res, exp_res)  # x + residual rounded once, as torch's add
    assert ((got_out.float() - exp_out.float()).abs() <= ulp.max()).all()
    assert (got_out == exp_out).float().mean() > 0.99
    # 3-D input (Qwen3's per-head q/k norm) keeps its shape
    heads = x.reshape(rows, -1, hidden)
    assert cpu_native.rms_norm(heads, weight, 1e-5).shape == heads.shape


@needs_kernels
@pytest.mark.parametrize("dim", [64, 128, 32])
def test_rotate_is_the_reference_bit_for_bit(dim):
    tokens, q_heads, kv_heads = 37, 6, 2
    rotary = RotaryEmbedding(dim, 4096, 10000.0)
    # q and k as one strided view of a packed qkv row, as the layer passes them
    qkv = rand(tokens, (q_heads + 2 * kv_heads) * dim, seed=dim, scale=4.0)
    qk = qkv[:, : (q_heads + kv_heads) * dim].view(tokens, q_heads + kv_heads, dim)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(1))
    cos_t, sin_t = rotary_tables_ref(rotary.cos, rotary.sin, positions, BF16)
    expected = rotate_ref(qk, cos_t, sin_t)
    assert torch.equal(cpu_native.rotate(qk, cos_t, sin_t), expected)


@needs_kernels
def test_store_kv_is_the_reference():
    tokens, kv_heads, dim, blocks, block_size = 20, 3, 64, 16, 8
    qkv = rand(tokens, (4 + 2 * kv_heads) * dim, seed=3)
    key = qkv[:, 4 * dim : (4 + kv_heads) * dim].view(tokens, kv_heads, dim)
    value = qkv[:, (4 + kv_heads) * dim :].view(tokens, kv_heads, dim)
    slots = torch.randperm(blocks * block_size, generator=torch.Generator().manual_seed(4))
    slots = slots[:tokens].clone()
    slots[[0, 7, 19]] = -1  # tokens not to store
    caches = [rand(blocks, block_size, kv_heads, dim, seed=5) for _ in range(2)]
    expected = [c.clone() for c in caches]
    store_kv_ref(key, value, *expected, slots)
    cpu_native.store_kv(key, value, *caches, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def _decode_inputs(lens, block_size, heads, kv_heads, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(needed) + 3
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(lens), max(needed) + 1, dtype=torch.int32)
    at = 0
    for i, n in enumerate(needed):
        tables[i, :n] = torch.tensor(pool[at : at + n], dtype=torch.int32)
        at += n
    k_cache = rand(num_blocks, block_size, kv_heads, dim, seed=seed + 1)
    v_cache = rand(num_blocks, block_size, kv_heads, dim, seed=seed + 2)
    # Slots past each context hold NaN: they must never reach the output.
    for i, n in enumerate(lens):
        for j in range(n, needed[i] * block_size):
            block = int(tables[i, j // block_size])
            k_cache[block, j % block_size] = float("nan")
            v_cache[block, j % block_size] = float("nan")
    q = rand(len(lens), heads + 2, dim, seed=seed + 3, scale=2.0)[:, 1 : heads + 1]  # strided
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


@needs_kernels
@pytest.mark.parametrize(
    "block_size,heads,kv_heads,dim",
    [(16, 9, 3, 64), (8, 4, 4, 128), (32, 8, 2, 64), (16, 12, 3, 48), (16, 6, 2, 40)],
)
def test_paged_decode_matches_reference(block_size, heads, kv_heads, dim):
    # Lengths: empty, one token, block edges, a long context, and the rest in between.
    lens = [0, 1, block_size, block_size + 1, 3 * block_size - 1, 300, 17, 64]
    q, k_cache, v_cache, tables, context_lens = _decode_inputs(
        lens, block_size, heads, kv_heads, dim, seed=block_size + dim
    )
    scale = dim**-0.5
    expected = paged_decode_ref(q, k_cache, v_cache, tables, context_lens, scale)
    out = cpu_native.paged_decode(q, k_cache, v_cache, tables, context_lens, scale, max(lens))
    assert out.shape == expected.shape and out.dtype == BF16
    assert torch.isfinite(out).all()
    assert (out[0] == 0).all()  # the empty context: zeros, as the kernel writes
    # The reference rounds the probabilities to bf16 before the sum over V; these stay fp32.
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    # ... so they are closer to the attention computed in fp32 throughout.
    exact = paged_decode_ref(
        q.float(), k_cache.float(), v_cache.float(), tables, context_lens, scale
    )
    assert (out.float() - exact).abs().mean() <= (expected.float() - exact).abs().mean()


@needs_kernels
def test_out_of_range_inputs_raise_before_any_write():
    # The C code trusts no index it reads memory with: each is checked first.
    q, k_cache, v_cache, tables, lens = _decode_inputs([5, 40], 16, 4, 2, 64, seed=0)
    with pytest.raises(ValueError, match="max_context_len"):
        cpu_native.paged_decode(q, k_cache, v_cache, tables, lens, 0.125, 39)
    with pytest.raises(ValueError, match="block_tables"):  # 40 tokens need 3 entries
        cpu_native.paged_decode(q, k_cache, v_cache, tables[:, :2], lens, 0.125, 40)
    bad = tables.clone()
    bad[1, 2] = k_cache.shape[0]  # a block id past the cache
    with pytest.raises(ValueError, match="block_tables"):
        cpu_native.paged_decode(q, k_cache, v_cache, bad, lens, 0.125, 40)
    key = rand(3, 2, 64, seed=1)
    caches = [torch.zeros(4, 16, 2, 64, dtype=BF16) for _ in range(2)]
    for slot in (64, -2):
        with pytest.raises(ValueError, match="slot"):
            cpu_native.store_kv(key, key, *caches, torch.tensor([0, slot, 1]))
        assert not caches[0].any() and not caches[1].any()


@needs_kernels
@pytest.mark.parametrize("entry", ENTRIES)
def test_the_calls_the_wrong_ones_start_from_run(entry):
    args = valid_args(entry)
    getattr(cpu_native, entry)(**args)
    if entry in ("store_kv", "rotary_decode"):
        assert args["k_cache"].any() and args["v_cache"].any()  # they did write


@needs_kernels
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_wrong_calls_raise_before_the_c_code_runs(case):
    # Each entry point checks every shape, dtype, device and stride the C code relies on;
    # a value with fewer tokens than the key once made store_kv read past it.
    problem = check(case)
    assert problem is None, problem


@needs_kernels
def test_wrong_calls_raise_without_asserts():
    # The same wrong calls under `python -O`, which strips asserts: the checks are real code.
    script = Path(__file__).with_name("cpu_native_bad_calls.py")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(script.parent)])}
    result = subprocess.run(
        [sys.executable, "-O", str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"all {len(CASES)} wrong calls raised" in result.stdout


@needs_kernels
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bf16_llm_runs_the_kernels_and_agrees_with_the_references(tmp_path, family):
    # One bf16 LLM, its layers bound to the C kernels, then to the torch references: the
    # same greedy first tokens (prefill) and close logprobs at the first decode steps.
    model = make_tiny_model(tmp_path / family, family)
    llm = LLM(str(model), device="cpu", dtype="bfloat16", kv_cache_memory=8 << 20)
    assert type(llm.runner.backend) is CpuNativeAttention
    prompts = [[1, 5, 9, 200, 31, 7], [4, 4, 4], list(range(10, 60))]
    params = SamplingParams(temperature=0, max_tokens=3, logprobs=5, ignore_eos=True)
    native = llm.generate(prompts, params, use_tqdm=False)
    TorchAttention().bind(llm.runner.model)  # its metadata is the C kernels' too
    reference = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(native, reference):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids[0] == b.token_ids[0]
        # Steps up to the first different token share their context.
        diff = [i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y]
        steps = diff[0] + 1 if diff else len(a.token_ids)
        for la, lb in zip(a.logprobs[:steps], b.logprobs[:steps]):
            shared = la.keys() & lb.keys()
            assert len(shared) >= 4
            for tok in shared:
                assert abs(la[tok].logprob - lb[tok].logprob) < 0.05, (tok, la[tok], lb[tok])


@needs_kernels
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (6, 2, 40)])
def test_rotary_decode_is_rotate_store_then_decode(heads, kv_heads, dim):
    # The fused call equals its three steps bit for bit: the same output and the same cache.
    lens = [7, 1, 33, 16, 90]
    block_size = 16
    _, k_cache, v_cache, tables, context_lens = _decode_inputs(
        lens, block_size, heads, kv_heads, dim, seed=dim
    )
    for i, n in enumerate(lens):  # the new token's slot held NaN (past the old context)
        block = int(tables[i, (n - 1) // block_size])
        k_cache[block, (n - 1) % block_size] = float("nan")
        v_cache[block, (n - 1) % block_size] = float("nan")
    batch = len(lens)
    qkv = rand(batch, (heads + 2 * kv_heads) * dim, seed=1, scale=2.0)
    q = qkv[:, : heads * dim].view(batch, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(batch, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(batch, kv_heads, dim)
    rotary = RotaryEmbedding(dim, 512, 10000.0)
    positions = torch.tensor([n - 1 for n in lens])
    slots = torch.tensor(
        [int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size
         for i, n in enumerate(lens)]
    )  # fmt: skip
    slots[3] = -1  # a token not to store: its slot keeps what it held
    caches = (k_cache.clone(), v_cache.clone())
    cos_t, sin_t = rotary_tables_ref(rotary.cos, rotary.sin, positions, BF16)
    qr, kr = cpu_native.rotate(q, cos_t, sin_t), cpu_native.rotate(k, cos_t, sin_t)
    cpu_native.store_kv(kr, v, k_cache, v_cache, slots)
    expected = cpu_native.paged_decode(qr, k_cache, v_cache, tables, context_lens, 0.1, 90)
    out = cpu_native.rotary_decode(
        q, k, v, positions, rotary.cos, rotary.sin, *caches, slots, tables, context_lens, 0.1, 90
    )
    assert torch.equal(torch.nan_to_num(caches[0]), torch.nan_to_num(k_cache))
    assert torch.equal(torch.nan_to_num(caches[1]), torch.nan_to_num(v_cache))
    assert torch.equal(torch.nan_to_num(out), torch.nan_to_num(expected))
    assert torch.isfinite(out[[0, 1, 2, 4]]).all()


@needs_kernels
def test_rotary_decode_rejects_positions_and_slots_out_of_range():
    q, k_cache, v_cache, tables, lens = _decode_inputs([5, 40], 16, 4, 2, 64, seed=0)
    kv = rand(2, 2, 64, seed=2)
    rotary = RotaryEmbedding(64, 64, 10000.0)
    before = k_cache.clone()
    for positions, slots in (([4, 64], [4, 20]), ([4, -1], [4, 20]), ([4, 39], [4, 10**6])):
        with pytest.raises(ValueError, match="position|slot"):
            cpu_native.rotary_decode(
                q, kv, kv, torch.tensor(positions), rotary.cos, rotary.sin, k_cache, v_cache,
                torch.tensor(slots), tables, lens, 0.125, 40,
            )  # fmt: skip
    assert torch.equal(torch.nan_to_num(k_cache), torch.nan_to_num(before))
