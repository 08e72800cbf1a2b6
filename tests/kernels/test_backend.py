"""The backend a model's layers compute with is chosen once, by the runner, not per tensor."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import torch
from kernel_inputs import DEVICE
from tiny_models import make_tiny_model

from nanopaged import LLM
from nanopaged.layers.activation import SiluAndMul
from nanopaged.layers.backend import TORCH, TRITON, UsesBackend, backend_for, bind_backend
from nanopaged.layers.norm import RMSNorm


def test_backend_for_device():
    assert backend_for("cpu") is TORCH and backend_for(torch.device("cpu")) is TORCH
    assert backend_for("cuda") is TRITON and backend_for("cuda:1") is TRITON
    assert backend_for("meta") is TORCH


def test_runner_binds_every_layer(tmp_path):
    model = make_tiny_model(tmp_path / "qwen3", "qwen3")
    llm = LLM(str(model), kv_cache_memory=4 << 20, max_model_len=32)
    layers = [m for m in llm.runner.model.modules() if isinstance(m, UsesBackend)]
    num_layers = len(llm.runner.attention_layers)
    kinds = Counter(type(m).__name__ for m in layers)
    # Per decoder layer: two norms, q/k norms, the activation, attention and four linears
    # (qkv, o, gate_up, down); the final norm and the LM head; one rotary table shared by the
    # layers.
    assert num_layers == 2
    assert kinds == {"RMSNorm": 4 * num_layers + 1, "SiluAndMul": num_layers,
                     "Attention": num_layers, "RotaryEmbedding": 1,
                     "QKVParallelLinear": num_layers, "RowParallelLinear": 2 * num_layers,
                     "MergedColumnParallelLinear": num_layers, "LMHead": 1}  # fmt: skip
    assert llm.runner.backend is backend_for(llm.runner.device)
    assert all(m.backend is llm.runner.backend for m in layers)


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
    # inside graph_gemms() (the graph runner's warm-up and capture) take it, where it wins.
    from nanopaged.layers import backend

    calls = []
    monkeypatch.setattr(
        backend.skinny_gemm, "skinny_linear", lambda x, w, b: calls.append(x.shape[0]) or x
    )
    linear = TRITON.linear
    small = torch.empty(1024, 64, dtype=torch.float16, device="meta")
    huge = torch.empty(1 << 26, 1, dtype=torch.float16, device="meta")  # 128 MB
    x = lambda m, dtype=torch.float16, k=64: torch.empty(m, k, dtype=dtype, device="meta")  # noqa: E731
    linear(x(1), small, None, None)  # eager step: cuBLAS
    assert calls == []
    with backend.graph_gemms():
        linear(x(1), small, None, None)
        linear(x(16), small, None, None)
        linear(x(17), small, None, None)  # too many rows
        linear(x(4, torch.float32), small.float(), None, None)  # fp32 stays exact: cuBLAS
        linear(x(1, k=1), huge, None, None)  # one row: the kernel at any size
        linear(x(2, k=1), huge, None, None)  # 2+ rows on a huge weight: cuBLAS
    assert calls == [1, 16, 1]
    linear(x(1), small, None, None)  # the block ended
    assert calls == [1, 16, 1]
