"""The backend a model computes with is chosen once, by the runner, not per tensor: one
attention backend per (device, dtype), naming the op table of the other layers."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import torch
from kernel_inputs import DEVICE
from tiny_models import make_tiny_model

from nanopaged import LLM, SamplingParams
from nanopaged.attention import (
    Attention,
    AttentionMetadata,
    CpuNativeAttention,
    TorchAttention,
    TorchMetadata,
    TritonAttention,
    TritonMetadata,
    attention_backend,
)
from nanopaged.kernels import cpu_native
from nanopaged.layers.activation import SiluAndMul
from nanopaged.layers.backend import (
    CPU_NATIVE,
    TORCH,
    TRITON,
    CudaLinear,
    UsesBackend,
    backend_for,
    bind_backend,
)
from nanopaged.layers.norm import RMSNorm

BF16 = torch.bfloat16


def test_op_table_for_tensors_outside_a_model():
    assert backend_for("cpu") is TORCH and backend_for(torch.device("cpu")) is TORCH
    assert backend_for("cuda") is TRITON and backend_for("cuda:1") is TRITON
    assert backend_for("meta") is TORCH


def test_attention_backend_by_device_and_dtype():
    for device in ("cuda", "cuda:1", torch.device("cuda")):
        for dtype in (BF16, torch.float16, torch.float32):
            backend = attention_backend(device, dtype)
            assert type(backend) is TritonAttention
            # The Triton table with a linear of the backend's own (its graph switch).
            assert backend.ops == replace(TRITON, linear=backend.ops.linear)
            assert isinstance(backend.ops.linear, CudaLinear)
            assert backend.ops.linear is not TRITON.linear
    a, b = attention_backend("cuda", BF16), attention_backend("cuda", BF16)
    assert a is not b and a.ops.linear is not b.ops.linear  # one per runner
    for device, dtype in (("cpu", torch.float16), ("meta", None)):
        backend = attention_backend(device, dtype)
        assert type(backend) is TorchAttention and backend.ops is TORCH
        assert backend.pack_weights  # a runner's CPU model: GEMM weights packed for oneDNN
    assert not TorchAttention().pack_weights  # on any device: weights as they are
    for dtype in (BF16, torch.float32):  # fp32: the C decode call, the rest as TORCH
        native = attention_backend("cpu", dtype)
        if cpu_native.available():
            assert type(native) is CpuNativeAttention and native.ops is CPU_NATIVE
        else:
            assert type(native) is TorchAttention and native.pack_weights


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _mixed_step() -> dict[str, np.ndarray]:
    # Two decode rows (contexts 9 and 30), then a prefill chunk of 4 tokens after 2 cached
    # ones, then a fresh prompt of 3: block size 8.
    q_lens, context_lens = [1, 1, 4, 3], [9, 30, 6, 3]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tables = np.arange(16, dtype=np.int32).reshape(4, 4)
    positions = np.concatenate([np.arange(n - q, n) for q, n in zip(q_lens, context_lens)])
    slots = np.arange(len(positions), dtype=np.int64)
    return dict(positions=positions.astype(np.int64), slots=slots, tables=tables,
                context_lens=np.asarray(context_lens, dtype=np.int32), cu_seqlens_q=cu)  # fmt: skip


def test_each_backend_prepares_its_own_metadata_fields_only():
    shared = _fields(AttentionMetadata)
    assert shared == {"slot_mapping", "block_tables", "context_lens", "cu_seqlens_q",
                      "max_seqlen_q", "max_context_len", "first_kv_pass"}  # fmt: skip
    host = _mixed_step()
    cpu = torch.device("cpu")
    positions, meta = TorchAttention().prepare_metadata(host, cpu)
    assert type(meta) is TorchMetadata
    assert _fields(TorchMetadata) - shared == {"decode_plan", "skips_slots"}
    assert meta.decode_plan is None and meta.skips_slots is None  # found by the first layer
    assert not hasattr(meta, "decode_order") and not hasattr(meta, "num_decodes")
    assert torch.equal(positions, torch.from_numpy(host["positions"]))
    assert meta.max_seqlen_q == 4 and meta.max_context_len == 30 and not meta.is_decode
    assert torch.equal(meta.block_tables, torch.from_numpy(host["tables"]))

    positions, meta = TritonAttention().prepare_metadata(host, cpu)
    assert type(meta) is TritonMetadata
    private = _fields(TritonMetadata) - shared
    assert private == {"has_prefix", "num_decodes", "cu_seqlens_prefill", "decode_order"}
    assert not hasattr(meta, "decode_plan") and not hasattr(meta, "skips_slots")
    # The two leading decode rows go to the decode kernel, longest context first; the
    # prefill kernel takes the rest with cu_seqlens from 0, one of them with a prefix.
    assert meta.num_decodes == 2 and meta.decode_order.tolist() == [1, 0]
    assert meta.cu_seqlens_prefill.tolist() == [0, 4, 7] and meta.has_prefix
    assert torch.equal(positions, torch.from_numpy(host["positions"]))

    decode = {k: v for k, v in host.items()}
    decode["cu_seqlens_q"] = np.arange(5, dtype=np.int32)
    decode["positions"] = decode["context_lens"].astype(np.int64) - 1
    decode["slots"] = np.arange(4, dtype=np.int64)
    _, meta = TritonAttention().prepare_metadata(decode, cpu)
    assert meta.is_decode and meta.num_decodes == 0 and meta.cu_seqlens_prefill is None
    assert meta.decode_order.tolist() == [1, 0, 2, 3]  # every row, through the decode kernel


def test_runner_binds_every_layer(tmp_path):
    model = make_tiny_model(tmp_path / "qwen3", "qwen3")
    llm = LLM(str(model), kv_cache_memory=4 << 20, max_model_len=32)
    runner = llm.runner
    layers = [m for m in runner.model.modules() if isinstance(m, UsesBackend)]
    num_layers = len(runner.attention_layers)
    kinds = Counter(type(m).__name__ for m in layers)
    # Per decoder layer: two norms, q/k norms, the activation and four linears (qkv, o,
    # gate_up, down); the final norm and the LM head; one rotary table shared by the layers.
    assert num_layers == 2
    assert kinds == {"RMSNorm": 4 * num_layers + 1, "SiluAndMul": num_layers,
                     "RotaryEmbedding": 1, "QKVParallelLinear": num_layers,
                     "RowParallelLinear": 2 * num_layers,
                     "MergedColumnParallelLinear": num_layers, "LMHead": 1}  # fmt: skip
    assert type(runner.backend) is type(attention_backend(runner.device, runner.dtype))
    assert all(m.backend is runner.backend.ops for m in layers)
    attention = [m for m in runner.model.modules() if isinstance(m, Attention)]
    assert attention == runner.attention_layers
    assert all(m.backend is runner.backend for m in attention)


def test_bound_backend_decides_not_the_device():
    # The same tensors through a spying torch backend, then through the Triton one (under the
    # interpreter when there is no GPU): the bound backend, not the device, picks the code.
    x = torch.randn(5, 64, device=DEVICE)
    res = torch.randn(5, 64, device=DEVICE)
    norm = RMSNorm(64, 1e-6).to(DEVICE)
    norm.weight.data = torch.rand(64, device=DEVICE) + 0.5
    calls = []

    def spy(*args):
        calls.append(args[0].shape)
        return TORCH.rms_norm(*args)

    bind_backend(norm, replace(TORCH, rms_norm=spy))
    expected, expected_res = norm(x, res)
    assert calls == [x.shape]
    bind_backend(norm, TRITON)
    out, out_res = norm(x, res)
    assert calls == [x.shape]
    torch.testing.assert_close(out_res, expected_res)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    act = SiluAndMul()
    gate_up = torch.randn(5, 128, device=DEVICE)
    bind_backend(act, TRITON)
    torch.testing.assert_close(act(gate_up), TORCH.silu_and_mul(gate_up), rtol=1e-5, atol=1e-5)


def test_small_gemms_take_the_skinny_kernel_in_graph_steps_only(monkeypatch):
    # The CUDA backend's linear, with the kernel replaced by a spy: 1-16 rows of 16-bit inputs
    # inside its backend's graph_capture() (the graph runner's warm-up and capture) take it,
    # where it wins.
    from nanopaged.layers import backend

    calls = []
    monkeypatch.setattr(
        backend.skinny_gemm, "skinny_linear", lambda x, w, b: calls.append(x.shape[0]) or x
    )
    attn, other = TritonAttention(), TritonAttention()
    linear = attn.ops.linear
    small = torch.empty(1024, 64, dtype=torch.float16, device="meta")
    huge = torch.empty(1 << 26, 1, dtype=torch.float16, device="meta")  # 128 MB
    x = lambda m, dtype=torch.float16, k=64: torch.empty(m, k, dtype=dtype, device="meta")  # noqa: E731
    linear(x(1), small, None, None)  # eager step: cuBLAS
    assert calls == []
    with attn.graph_capture():
        linear(x(1), small, None, None)
        linear(x(16), small, None, None)
        linear(x(17), small, None, None)  # too many rows
        linear(x(4, torch.float32), small.float(), None, None)  # fp32 stays exact: cuBLAS
        linear(x(1, k=1), huge, None, None)  # one row: the kernel at any size
        linear(x(2, k=1), huge, None, None)  # 2+ rows on a huge weight: cuBLAS
        # The switch is this backend's: another runner's table and TRITON stay eager.
        other.ops.linear(x(1), small, None, None)
        TRITON.linear(x(1), small, None, None)
    assert calls == [1, 16, 1]
    linear(x(1), small, None, None)  # the block ended
    assert calls == [1, 16, 1]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_triton_backend_gives_the_torch_backends_tokens(tmp_path, family):
    # One fp32 LLM through the torch references, then the same runner with the Triton backend
    # bound (the interpreter on a CPU): its own metadata, rotary kernels that store K/V, and
    # mixed steps (a small token budget chunks the long prompt beside running decodes; no
    # prefix cache, so both runs schedule alike).
    model = make_tiny_model(tmp_path / family, family)
    llm = LLM(str(model), device=DEVICE, dtype="float32", kv_cache_memory=4 << 20,
              max_model_len=64, max_num_batched_tokens=16, enforce_eager=True,
              enable_prefix_caching=False)  # fmt: skip
    prompts = [[1, 2, 3, 4, 5], list(range(10, 33)), [7, 7]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    runner = llm.runner
    runner.backend = TorchAttention()
    runner.backend.bind(runner.model)
    reference = llm.generate(prompts, params, use_tqdm=False)
    runner.backend = TritonAttention()
    runner.backend.bind(runner.model)
    metas = []
    prepare = runner.backend.prepare_metadata

    def spy(host, device):
        positions, meta = prepare(host, device)
        metas.append(meta)
        return positions, meta

    runner.backend.prepare_metadata = spy
    kernels = llm.generate(prompts, params, use_tqdm=False)
    assert all(type(m) is TritonMetadata for m in metas)
    assert any(m.num_decodes and not m.is_decode for m in metas), "no mixed step ran"
    for a, b in zip(kernels, reference):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            for tok in la.keys() & lb.keys():
                assert abs(la[tok].logprob - lb[tok].logprob) < 1e-3
