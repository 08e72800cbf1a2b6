"""Mixture-of-experts Qwen: greedy tokens equal HF's (fp32, CPU), under tensor parallelism too;
random weights from config.json alone; bad MoE configs and checkpoints refused by name."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import hf_greedy, make_tiny_model

from nanopaged import LLM, SamplingParams
from nanopaged.layers.moe import SparseMoeBlock
from nanopaged.loader import _dummy_tensors
from nanopaged.models.llama import DecoderMLP, checkpoint_shapes

MAX_TOKENS = 24
PROMPT_LENS = (1, 3, 17, 40, 100)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# name -> (family, overrides, which layers are sparse)
MODELS = {
    "qwen3_moe-norm-dense1": (
        "qwen3_moe", dict(norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=3),
        [True, False, True],
    ),
    "qwen3_moe-step2": (
        "qwen3_moe", dict(norm_topk_prob=False, decoder_sparse_step=2, num_hidden_layers=3),
        [False, True, False],
    ),
    "qwen2_moe-shared": ("qwen2_moe", dict(num_experts_per_tok=3), [True, True]),
}  # fmt: skip


def _prompts(vocab: int = 512, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=list(MODELS))
def moe_model(request, tmp_path_factory):
    family, overrides, sparse = MODELS[request.param]
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), family, **overrides)
    prompts = _prompts()
    return path, sparse, prompts, hf_greedy(path, prompts, MAX_TOKENS)


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("max_num_batched_tokens", [48, 8192])
def test_moe_greedy_matches_hf(moe_model, prefix_caching, max_num_batched_tokens):
    path, sparse, prompts, expected = moe_model
    llm = LLM(str(path), dtype="float32", block_size=8, enable_prefix_caching=prefix_caching,
              max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=1 << 22)  # fmt: skip
    layers = llm.runner.model.model.layers
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == sparse
    assert all(isinstance(layer.mlp, DecoderMLP) for layer, s in zip(layers, sparse) if not s)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    if prefix_caching:  # again, the prompts' full blocks from the cache
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert outs[-1].num_cached_tokens > 0


def test_moe_tp2_matches_hf(tmp_path):
    """Two ranks (gloo): every expert's and the shared expert's intermediate dim split."""
    path = make_tiny_model(tmp_path / "qwen2_moe", "qwen2_moe", mlp_only_layers=[0])
    prompts = _prompts(seed=1)
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    with LLM(str(path), dtype="float32", tensor_parallel_size=2, block_size=8,
             max_num_batched_tokens=48, kv_cache_memory=1 << 22) as llm:  # fmt: skip
        experts = llm.runner.model.model.layers[1].mlp.experts
        assert experts.w13.shape == (8, 32, 64)  # 8 experts, [gate; up] of 16 rows each
        for _ in range(2):  # the second time through the prefix cache
            outs = llm.generate(prompts, GREEDY, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == expected


def test_moe_dummy_weights(tmp_path):
    """load_format="dummy" from config.json alone: each expert's tensors land in its slot."""
    src = make_tiny_model(tmp_path / "src", "qwen2_moe", num_hidden_layers=2)
    cfg_only = tmp_path / "config-only"
    cfg_only.mkdir()
    (cfg_only / "config.json").write_text((src / "config.json").read_text())
    llm = LLM(str(cfg_only), load_format="dummy", kv_cache_memory=1 << 22, seed=5)
    block = llm.runner.model.model.layers[1].mlp
    names = {"model.layers.1.mlp.experts.5.up_proj.weight",
             "model.layers.1.mlp.experts.7.down_proj.weight",
             "model.layers.1.mlp.shared_expert_gate.weight"}  # fmt: skip
    shapes = {n: s for n, s in checkpoint_shapes(llm.model_config).items() if n in names}
    drawn = {n: t for n, t, _ in _dummy_tensors(shapes, 5, torch.float32, torch.device("cpu"))}
    assert len(shapes) == 3
    layer = "model.layers.1.mlp"
    assert torch.equal(block.experts.w13[5, 32:], drawn[f"{layer}.experts.5.up_proj.weight"])
    assert torch.equal(block.experts.w2[7], drawn[f"{layer}.experts.7.down_proj.weight"])
    assert torch.equal(block.shared_expert_gate.weight, drawn[f"{layer}.shared_expert_gate.weight"])
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(num_local_experts=-1), r"num_local_experts in .* must be an integer >= 0, got -1"),
        (dict(num_experts_per_tok=9), r"num_experts_per_tok \(9\) .* exceeds num_local_experts"),
        (dict(num_experts_per_tok=0), r"num_experts_per_tok in .* must be an integer >= 1"),
        (dict(moe_intermediate_size=None), r"moe_intermediate_size in .* must be an integer"),
        (dict(decoder_sparse_step=0), r"decoder_sparse_step in .* must be an integer >= 1"),
        (dict(norm_topk_prob="yes"), r"norm_topk_prob in .* must be true or false, got 'yes'"),
        (dict(mlp_only_layers=[2]), r"mlp_only_layers in .* layer indices in \[0, 2\)"),
        (dict(mlp_only_layers=3), r"mlp_only_layers in .* must be a list"),
    ],
)  # fmt: skip
def test_bad_moe_config(qwen3_moe_dir, tmp_path, change, match):
    cfg = json.loads((qwen3_moe_dir / "config.json").read_text())
    cfg.update(change)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").symlink_to(qwen3_moe_dir / "model.safetensors")
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path), kv_cache_memory=1 << 22)


def test_moe_tp_size_must_divide_expert_width(qwen3_moe_dir, tmp_path):
    cfg = json.loads((qwen3_moe_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, moe_intermediate_size=30)))
    # 4 ranks split the heads and the dense MLP, not 30 expert rows; refused before any worker
    with pytest.raises(ValueError, match=r"=4 must divide the model.s moe_intermediate_size"):
        LLM(str(tmp_path), tensor_parallel_size=4, kv_cache_memory=1 << 22)


def test_moe_checkpoint_missing_or_extra_expert(qwen3_moe_dir, tmp_path):
    tensors = load_file(qwen3_moe_dir / "model.safetensors")
    (tmp_path / "config.json").write_text((qwen3_moe_dir / "config.json").read_text())
    missing = dict(tensors)
    del missing["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(missing, tmp_path / "model.safetensors")
    want = r"weights missing .*layers\.1\.mlp\.experts\.w13#\(3, 'up'\)"
    with pytest.raises(ValueError, match=want):
        LLM(str(tmp_path), kv_cache_memory=1 << 22)
    extra = dict(tensors)
    extra["model.layers.0.mlp.experts.8.gate_proj.weight"] = torch.zeros(32, 64)
    save_file(extra, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"experts\.8\.gate_proj.* expert 8 is outside \[0, 8\)"):
        LLM(str(tmp_path), kv_cache_memory=1 << 22)


# ---- GPU: the Triton kernel inside the engine, CUDA graphs on ------------------------------
GPU_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=64, num_hidden_layers=3, vocab_size=1024,
                 num_experts=32, num_experts_per_tok=4, moe_intermediate_size=128,
                 max_position_embeddings=2048)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_gpu_moe_fp32_matches_hf(tmp_path, family):
    extra = dict(mlp_only_layers=[1], norm_topk_prob=True) if family == "qwen3_moe" else {}
    path = make_tiny_model(tmp_path / family, family, **GPU_SHAPE, **extra)
    rng = random.Random(4)
    prompts = [[rng.randrange(1024) for _ in range(rng.randint(1, 300))] for _ in range(12)]
    expected = hf_greedy(path, prompts, 32)
    llm = LLM(str(path), dtype="float32", device="cuda", max_num_batched_tokens=512,
              max_num_seqs=32, kv_cache_memory=1 << 28)  # fmt: skip
    assert llm.runner.graphs is not None  # decode replays graphs holding the MoE kernels
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
