"""Greedy tokens equal HF transformers' on tiny random Llama / Qwen2 / Qwen3 models (fp32, CPU)."""

from __future__ import annotations

import random

import pytest
from tiny_models import FAMILIES, hf_greedy, make_tiny_model

from nanopaged import LLM, SamplingParams

MAX_TOKENS = 32
PROMPT_LENS = (1, 3, 9, 17, 40, 100, 128)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    family = request.param
    path = make_tiny_model(tmp_path_factory.mktemp(family), family)
    prompts = _prompts(512)
    return path, prompts, hf_greedy(path, prompts, MAX_TOKENS)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("max_num_batched_tokens", [48, 8192])
def test_greedy_matches_hf(family_model, block_size, prefix_caching, max_num_batched_tokens):
    path, prompts, expected = family_model
    llm = LLM(
        str(path),
        dtype="float32",
        block_size=block_size,
        enable_prefix_caching=prefix_caching,
        max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_memory=1 << 22,
    )
    free_before = llm.block_manager.num_free_blocks
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert llm.block_manager.num_free_blocks == free_before


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("qwen3", dict(tie_word_embeddings=True)),
        (
            "llama",
            dict(
                rope_parameters=dict(
                    rope_type="llama3",
                    rope_theta=50000.0,
                    factor=8.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=64,
                ),
                head_dim=32,
            ),
        ),
        ("qwen2", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    ],
    ids=["qwen3-tied", "llama3-rope-head_dim", "qwen2-mqa-tied"],
)
def test_model_variants_match_hf(tmp_path, family, overrides):
    """Tied head, llama3 rope scaling, explicit head_dim, one KV head, sharded safetensors."""
    path = make_tiny_model(tmp_path / family, family, seed=1, **overrides)
    # Re-save in small shards so loading walks several files.
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    model.save_pretrained(path, max_shard_size="100KB")
    assert len(list(path.glob("*.safetensors"))) > 1
    prompts = _prompts(512, seed=1)[:4] + [list(range(200, 330))]
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=1 << 22)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_preemption_gives_same_tokens(tmp_path):
    """A KV budget far under the batch's needs preempts and recomputes, with equal tokens."""
    path = make_tiny_model(tmp_path / "llama", "llama")
    prompts = _prompts(512, seed=2)[:2] + [list(range(i, i + 30)) for i in range(0, 480, 40)]
    ref_llm = LLM(str(path), dtype="float32", kv_cache_memory=1 << 22, block_size=8)
    expected = [o.outputs[0].token_ids for o in ref_llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert ref_llm.scheduler.num_preemptions == 0
    per_block = ref_llm.runner.kv_bytes_per_block
    need = sum(-(-(len(p) + MAX_TOKENS) // 8) for p in prompts)
    num_blocks = need // 3 - 1
    llm = LLM(
        str(path),
        dtype="float32",
        kv_cache_memory=per_block * num_blocks,
        block_size=8,
        max_model_len=96,
    )
    assert llm.block_manager.num_blocks == num_blocks
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.scheduler.num_preemptions > 0
    assert llm.block_manager.num_free_blocks == num_blocks


def test_prefix_cache_hits_keep_tokens(tmp_path):
    path = make_tiny_model(tmp_path / "qwen3", "qwen3")
    rng = random.Random(3)
    prefix = [rng.randrange(512) for _ in range(70)]
    first = [prefix + [rng.randrange(512) for _ in range(5)] for _ in range(2)]
    second = [prefix + [rng.randrange(512) for _ in range(n)] for n in (1, 7, 20)]
    expected = hf_greedy(path, second, MAX_TOKENS)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=1 << 22, block_size=16)
    free_before = llm.block_manager.num_free_blocks
    llm.generate(first, GREEDY, use_tqdm=False)
    outs = llm.generate(second, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    # 70 shared tokens hold 4 full blocks of 16
    assert all(o.num_cached_tokens == 64 for o in outs)
    assert llm.block_manager.num_free_blocks == free_before


def test_fully_cached_prompt(tmp_path):
    """A prompt whose every block is cached still yields logits (its last block recomputes)."""
    path = make_tiny_model(tmp_path / "qwen2", "qwen2")
    prompt = list(range(1, 65))  # exactly 4 blocks of 16
    expected = hf_greedy(path, [prompt], MAX_TOKENS)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=1 << 22, block_size=16)
    for _ in range(3):
        out = llm.generate([prompt, prompt], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == expected * 2
    assert out[0].num_cached_tokens == 48
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
