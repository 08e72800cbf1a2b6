"""platform.py: what the engine asks a CPU platform, and the checks built on its answers."""

from __future__ import annotations

import os

import pytest
import torch

from nanopaged import platform
from nanopaged.config import resolve_kv_cache_dtype
from nanopaged.distributed.workers import check_device_count
from nanopaged.engine.swap import allocate_cpu_kv_cache, swap_blocks
from nanopaged.platform import CPU, CUDA, platform_of, resolve_device
from nanopaged.platform import cpu_native_bf16 as native_bf16_probe  # unpatched (conftest)


def test_platform_of_names_the_device_kind():
    assert platform_of("cpu") is CPU and platform_of(torch.device("cpu")) is CPU
    assert platform_of("cuda:1") is CUDA and platform_of(torch.device("cuda")) is CUDA
    assert (CPU.dist_backend, CUDA.dist_backend) == ("gloo", "nccl")
    assert not CPU.async_scheduling and CUDA.async_scheduling


def test_default_dtypes(monkeypatch):
    monkeypatch.setattr(platform, "cpu_native_bf16", lambda: False)
    for checkpoint in (torch.float32, torch.float16, torch.bfloat16):
        assert CPU.default_dtype(checkpoint) == torch.float32
    monkeypatch.setattr(platform, "cpu_native_bf16", lambda: True)
    for checkpoint in (torch.float32, torch.float16, torch.bfloat16):
        assert CPU.default_dtype(checkpoint) == torch.bfloat16
    assert CUDA.default_dtype(torch.float32) == torch.bfloat16
    assert CUDA.default_dtype(torch.float16) == torch.float16


def test_cpu_native_bf16_reads_amx_or_avx512_bf16(monkeypatch):
    def probe(amx: bool, avx512_bf16: bool, mkldnn: bool = True) -> bool:
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: mkldnn)
        native_bf16_probe.cache_clear()
        try:
            return native_bf16_probe()
        finally:
            native_bf16_probe.cache_clear()

    assert probe(amx=True, avx512_bf16=False) and probe(amx=False, avx512_bf16=True)
    assert not probe(amx=False, avx512_bf16=False)  # AVX2 or plain AVX-512: no native bf16
    assert not probe(amx=True, avx512_bf16=True, mkldnn=False)  # no oneDNN to run bf16 GEMMs


@pytest.mark.parametrize("native", [False, True])
def test_llm_default_dtype_on_the_cpu(monkeypatch, byte_llama, native):
    from nanopaged import LLM, SamplingParams

    monkeypatch.setattr(platform, "cpu_native_bf16", lambda: native)
    want = torch.bfloat16 if native else torch.float32
    llm = LLM(str(byte_llama), device="cpu", kv_cache_memory=1 << 20)
    assert llm.llm_engine.dtype == want
    assert next(llm.runner.model.parameters()).dtype == want
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    explicit = LLM(str(byte_llama), device="cpu", dtype="float32", kv_cache_memory=1 << 20)
    assert explicit.llm_engine.dtype == torch.float32


def test_cpu_answers():
    cpu = torch.device("cpu")
    assert CPU.is_available()
    assert CPU.device_count() is None  # every rank shares the CPU
    assert CPU.rank_device(3) == cpu
    assert CPU.compute_capability(cpu) is None
    assert CPU.profiler_activities() == [torch.profiler.ProfilerActivity.CPU]


def test_cpu_ranks_share_the_cores():
    before = torch.get_num_threads()
    try:
        assert CPU.bind_rank(1, 2) == torch.device("cpu")
        assert torch.get_num_threads() == max(1, (os.cpu_count() or 1) // 2)
    finally:
        torch.set_num_threads(before)


def test_checks_that_ask_the_platform():
    cpu = torch.device("cpu")
    check_device_count(64, cpu)  # CPU ranks: any number
    dtype = getattr(torch, "float8_e4m3fn", None)
    if dtype is not None:
        assert resolve_kv_cache_dtype("fp8", cpu) == dtype
    assert resolve_kv_cache_dtype("auto", cpu) is None
    with pytest.raises(ValueError, match="device must be 'auto', 'cpu' or 'cuda"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == cpu
        with pytest.raises(ValueError, match="no CUDA device is available"):
            resolve_device("cuda")


def test_swap_round_trip_on_the_cpu():
    # kv_cache: [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]
    kv = torch.randn(2, 2, 6, 4, 2, 8)
    pool = allocate_cpu_kv_cache(kv, 3)
    assert pool.shape == (2, 2, 3, 4, 2, 8) and not pool.is_pinned()
    swap_blocks(kv, pool, [(5, 0), (1, 2)])
    torch.testing.assert_close(pool[:, :, 0], kv[:, :, 5], rtol=0, atol=0)
    torch.testing.assert_close(pool[:, :, 2], kv[:, :, 1], rtol=0, atol=0)
    swap_blocks(pool, kv, [(0, 3)])
    torch.testing.assert_close(kv[:, :, 3], kv[:, :, 5], rtol=0, atol=0)
