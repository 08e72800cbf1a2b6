"""On the GPU: Triton kernels inside the engine equal HF; CUDA graphs equal eager mode."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import hf_greedy, make_tiny_model

from nanopaged import LLM, SamplingParams
from nanopaged.engine.sequence import Sequence

pytestmark = pytest.mark.gpu

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, num_hidden_layers=3, vocab_size=1024,
             max_position_embeddings=2048)  # fmt: skip


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1024) for _ in range(rng.randint(1, 300))] for _ in range(n)]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3", **SHAPE)


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("enforce_eager", [True, False])
@pytest.mark.parametrize("block_size", [16, 32])
def test_fp32_greedy_matches_hf(qwen3, enforce_eager, block_size, async_scheduling):
    prompts = _prompts(12, seed=block_size)
    expected = hf_greedy(qwen3, prompts, 32)
    llm = LLM(str(qwen3), dtype="float32", device="cuda", block_size=block_size,
              max_num_batched_tokens=512, enforce_eager=enforce_eager, max_num_seqs=32,
              kv_cache_memory=1 << 28, async_scheduling=async_scheduling)  # fmt: skip
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                        use_tqdm=False)  # fmt: skip
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert (llm.scheduler.num_advanced_steps > 0) == async_scheduling


@pytest.mark.parametrize("num_prompts", [3, 5, 13, 17, 33, 47])
def test_cuda_graphs_equal_eager(qwen3, num_prompts):
    """Batch sizes between graph buckets (1, 2, 4, 8, 16, 32, 48) pad and still agree."""
    prompts = _prompts(num_prompts, seed=num_prompts)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = []
    for eager in (True, False):
        llm = LLM(str(qwen3), dtype="float32", device="cuda", enforce_eager=eager,
                  max_num_seqs=48, kv_cache_memory=1 << 28)  # fmt: skip
        assert (llm.runner.graphs is None) == eager
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                      use_tqdm=False)])
        del llm
    assert results[0] == results[1]


GRAPH_SAMPLING = {
    "greedy": [dict(temperature=0)],
    "plain": [dict(temperature=0.8), dict(temperature=0)],
    "plain_min_p": [dict(temperature=0.8, min_p=0.05)],
    "frontier": [dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, min_p=0.1, top_p=0.5)],
    "full": [dict(temperature=0.7, top_k=20), dict(temperature=0), dict(top_p=0.8)],
}


@pytest.mark.parametrize("path", list(GRAPH_SAMPLING))
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_graph_sampling_equals_eager(qwen3, path, async_scheduling):
    """The LM head and the sampler captured in the decode graphs give eager mode's tokens, for
    every sampler path, batch sizes between buckets (13 pads to 16, then fewer as requests
    finish) included."""
    prompts = _prompts(13, seed=3)
    settings = GRAPH_SAMPLING[path]
    params = [SamplingParams(max_tokens=8 + 2 * i, ignore_eos=True, seed=i,
                             **settings[i % len(settings)])
              for i in range(len(prompts))]  # fmt: skip
    results = []
    for eager in (True, False):
        llm = LLM(str(qwen3), dtype="float32", device="cuda", enforce_eager=eager,
                  max_num_seqs=16, kv_cache_memory=1 << 28,
                  async_scheduling=async_scheduling)  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outs])
        if not eager:
            sampled = llm.runner.graphs.sampled_steps
            assert set(sampled) == {path} and sampled[path] > 0, sampled
        del llm
    assert results[0] == results[1]


def test_rows_join_the_graph_sampler_once_min_tokens_is_reached(qwen3):
    """min_tokens masks its rows' stop tokens outside the graph; once every row has reached
    it the steps sample inside. Tokens equal eager mode's, and no banned token comes early."""
    prompts = _prompts(6, seed=5)
    banned = list(range(0, 1024, 3))  # a third of the vocabulary: the mask matters
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=i, min_tokens=6, max_tokens=16,
                             stop_token_ids=banned) for i in range(len(prompts))]  # fmt: skip
    results = []
    for eager in (True, False):
        llm = LLM(str(qwen3), dtype="float32", device="cuda", enforce_eager=eager,
                  max_num_seqs=8, kv_cache_memory=1 << 28)  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outs])
        if not eager:
            assert llm.runner.graphs.sampled_steps["frontier"] > 0
        del llm
    assert results[0] == results[1]
    for tokens in results[1]:
        assert len(tokens) >= 6 and not set(tokens[:6]) & set(banned), tokens


def test_steps_with_logprobs_sample_outside_the_graph(qwen3):
    prompts = _prompts(5, seed=4)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=8, logprobs=2)
    results = []
    for eager in (True, False):
        llm = LLM(str(qwen3), dtype="float32", device="cuda", enforce_eager=eager,
                  max_num_seqs=8, kv_cache_memory=1 << 28)  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob)
                        for o in outs])  # fmt: skip
        if not eager:
            assert not llm.runner.graphs.sampled_steps
        del llm
    # The same tokens; their logprobs within fp32 rounding of the two forward passes.
    assert [r[0] for r in results[0]] == [r[0] for r in results[1]]
    assert [r[1] for r in results[0]] == pytest.approx([r[1] for r in results[1]], rel=1e-5)


def test_bf16_teacher_forced_argmax_agrees_with_hf(qwen3):
    """Prefill over whole sequences in bf16: per-position argmax vs HF fp32 >= 95%."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen3, dtype=torch.float32).cuda()
    llm = LLM(str(qwen3), dtype="bfloat16", device="cuda", enforce_eager=True,
              kv_cache_memory=1 << 28)  # fmt: skip
    runner, bm = llm.runner, llm.block_manager
    agree = total = 0
    max_diff = 0.0
    for tokens in _prompts(8, seed=7):
        seq = Sequence(tokens, SamplingParams())
        assert bm.allocate(seq, [], len(tokens))
        with torch.inference_mode():
            positions, meta = runner._metadata([len(tokens)], [0], [seq.block_table])
            ids = torch.tensor(tokens, device="cuda")
            logits = runner.model.compute_logits(runner.model(ids, positions, meta)).float()
            ref = hf(ids[None]).logits[0].float()
        bm.free(seq)
        agree += (logits.argmax(-1) == ref.argmax(-1)).sum().item()
        total += len(tokens)
        max_diff = max(max_diff, (logits - ref).abs().max().item())
    print(f"bf16 teacher-forced argmax agreement {agree / total:.4f}, max |dlogit| {max_diff:.4f}")
    assert agree / total >= 0.95


def test_kv_budget_from_memory_utilization(qwen3):
    """The cache takes what the utilization cap leaves; too little for one sequence refuses."""
    llm = LLM(str(qwen3), device="cuda", gpu_memory_utilization=0.5, max_num_seqs=4)
    # capped by what max_num_seqs sequences of max_model_len can use
    per_seq = -(-llm.max_model_len // llm.config.block_size)
    assert llm.runner.num_blocks == 4 * per_seq
    del llm
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    # What is in use now, less the blocks torch keeps cached for reuse (earlier tests in the
    # process can leave partly used segments that empty_cache cannot return).
    slack = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    used_fraction = (total - free - slack) / total
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(str(qwen3), device="cuda", gpu_memory_utilization=max(used_fraction, 1e-4))


def test_dropped_llm_frees_its_gpu_memory_without_the_collector(qwen3):
    # Start-up's objects are frozen out of the garbage collector's view, so a dropped LLM
    # (CUDA graphs, async scheduling, a sampled and a penalized run) must be freed by
    # reference counting alone: its KV cache and graphs go at `del`.
    import gc
    import weakref

    gc.collect()  # earlier tests' garbage, which start-up collects, out of the baseline
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    llm = LLM(str(qwen3), dtype="bfloat16", device="cuda", kv_cache_memory=1 << 28)
    assert llm.runner.graphs is not None
    llm.generate(_prompts(5, seed=1), [
        SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3),
    ] * 2 + [SamplingParams(n=2, temperature=1.0, max_tokens=8, logprobs=2)], use_tqdm=False)
    assert torch.cuda.memory_allocated() - base >= 1 << 28
    refs = [weakref.ref(o) for o in (llm, llm.runner, llm.runner.model, llm.runner.graphs)]
    gc.disable()
    try:
        del llm
        assert all(r() is None for r in refs), [r() is None for r in refs]
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() - base < 1 << 24
    finally:
        gc.enable()


def test_a_collection_inside_a_graph_capture_cannot_invalidate_it(qwen3, monkeypatch):
    """An LLM only the garbage collector can free (a cycle, as an exception's traceback makes
    one) becomes garbage as another LLM starts capturing, with the collector's thresholds at
    their lowest: a collection inside the capture would free its graphs and memory there,
    which CUDA refuses during a capture. The new LLM starts and equals eager mode."""
    import gc
    import weakref

    old = LLM(str(qwen3), dtype="float32", device="cuda", kv_cache_memory=1 << 26)
    freed = weakref.ref(old)
    holder = [[old]]
    holder[0].append(holder[0])  # the cycle holds the LLM
    del old
    thresholds = gc.get_threshold()
    real = torch.cuda.CUDAGraph.capture_begin

    def capture_begin(graph, *args, **kwargs):
        real(graph, *args, **kwargs)
        if holder:  # the first capture: the cycle becomes garbage, collections come often
            holder.clear()
            gc.set_threshold(1, 1, 1)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", capture_begin)
    try:
        llm = LLM(str(qwen3), dtype="float32", device="cuda", kv_cache_memory=1 << 26)
    finally:
        gc.set_threshold(*thresholds)
    assert not holder
    gc.collect()
    assert freed() is None
    prompts = _prompts(6, seed=3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    eager = LLM(str(qwen3), dtype="float32", device="cuda", kv_cache_memory=1 << 26,
                enforce_eager=True)  # fmt: skip
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


def test_start_up_compiles_the_prefill_variants_and_leaves_the_cache_zeroed(qwen3):
    """The dummy prefill passes at start-up (ModelRunner._compile_prefill) leave no K/V
    behind, and a workload of short, long, chunked and prefix-cached prompts then launches
    no prefill kernel variant for the first time (a proof only where this process had not
    launched them before: run this test alone; tests/e2e/test_async_scheduling.py checks on
    the CPU that the passes run)."""
    import bench

    llm = LLM(str(qwen3), dtype="bfloat16", device="cuda", kv_cache_memory=1 << 28,
              max_model_len=2048, max_num_batched_tokens=1024)  # fmt: skip
    assert int(llm.runner.kv_cache.count_nonzero()) == 0
    rng = random.Random(0)
    prompts = [[rng.randrange(1024) for _ in range(n)] for n in (3, 40, 300, 700, 1500)]
    prompts.append(prompts[3][:600] + [5, 6, 7])  # a cached prefix, then its own chunk
    with bench.new_kernel_variants() as variants:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert "_paged_prefill_kernel" not in variants, variants


def test_start_up_compiles_the_split_merge_for_every_split_count(qwen3):
    """Start-up compiles the split merge for each count choose_num_splits can pick
    (TritonAttention.compile_ahead): decode launches at each count then launch no merge
    variant for the first time (a proof only where this process had not launched them before:
    run this test alone)."""
    import bench
    from nanopaged.kernels.paged_decode import decode_config, paged_decode_launch

    llm = LLM(str(qwen3), dtype="bfloat16", device="cuda", kv_cache_memory=1 << 28,
              max_model_len=2048)  # fmt: skip
    layer = llm.runner.attention_layers[0]
    q = torch.randn(2, layer.num_heads, layer.head_dim, dtype=torch.bfloat16, device="cuda")
    tables = torch.zeros(2, 1, dtype=torch.int32, device="cuda")
    context_lens = torch.ones(2, dtype=torch.int32, device="cuda")
    launch = decode_config(layer.head_dim, q.dtype, layer.k_cache.dtype)
    with bench.new_kernel_variants() as variants:
        for splits in (2, 3, 5, 9, 17, 33, 64):
            paged_decode_launch(q, layer.k_cache, layer.v_cache, tables, context_lens,
                                layer.scale, splits, *launch)  # fmt: skip
    assert "_merge_splits_kernel" not in variants, variants
