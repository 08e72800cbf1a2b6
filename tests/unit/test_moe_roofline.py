"""bench.py's decode roofline counts, for MoE models, only the experts a step touches."""

from __future__ import annotations

from tiny_models import make_tiny_model

import bench
from nanopaged import LLM


def test_roofline_counts_touched_experts(tmp_path):
    path = make_tiny_model(tmp_path / "moe", "qwen3_moe", num_hidden_layers=2, mlp_only_layers=[1])
    llm = LLM(str(path), kv_cache_memory=1 << 22)
    c = llm.model_config  # 8 experts, top-2, hidden 64, moe_intermediate 32, fp32
    params = sum(p.numel() for p in llm.runner.model.parameters()) * 4
    one_expert = 3 * 64 * 32 * 4  # gate, up and down of one expert of the one sparse layer
    kv_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    dense = params - 8 * one_expert
    # One request, one step: its one token reads exactly top_k experts.
    got = bench.decode_roofline_bytes(llm, [[1, 2, 3]], [1])
    assert got == 3 * kv_per_token + dense + 2 * one_expert
    # 100 sequences in flight for one step: nearly all 8 experts, 8 * (1 - (3/4) ** 100).
    got = bench.decode_roofline_bytes(llm, [[1]] * 100, [1] * 100)
    assert abs(got - (100 * kv_per_token + dense + 8 * (1 - 0.75**100) * one_expert)) < 1e-3
