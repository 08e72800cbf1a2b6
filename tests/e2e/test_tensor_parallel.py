"""tensor_parallel_size=2 gives HF's greedy tokens (gloo on CPU; NCCL and CUDA graphs on GPUs),
and its worker processes end with their LLM and report their errors."""

from __future__ import annotations

import gc
import multiprocessing as mp
import random
import time
import weakref

import pytest
import torch
from tiny_models import AMPLIFY, amplified_kv, hf_greedy, make_tiny_model

from nanopaged import LLM, SamplingParams
from nanopaged.distributed.parallel import PEER_ALL_REDUCE_ENV
from nanopaged.distributed.workers import FAULT_ENV, START_METHOD_ENV, WorkerError

MAX_TOKENS = 16
PROMPT_LENS = (1, 9, 40, 100)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# family -> overrides: qwen2 has one KV head (copied onto both ranks) and a tied head; qwen3 an
# odd vocabulary (the vocabulary-parallel embedding and head pad it).
MODELS = {
    "llama": dict(mlp_bias=True),  # a row-parallel bias: added once, by rank 0's part
    "qwen2": dict(num_key_value_heads=1, tie_word_embeddings=True),
    "qwen3": dict(vocab_size=511),
}


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENS]


def _worker_processes() -> list:
    """Processes this test process started for tensor parallelism that are still alive."""
    procs = list(mp.active_children())
    try:
        import psutil
    except ImportError:
        return procs
    me = psutil.Process()
    for child in me.children(recursive=True):
        try:
            # Spawned workers run spawn_main; forked ones keep this process's command line.
            cmdline = child.cmdline()
            if "spawn_main" in " ".join(cmdline) or cmdline == me.cmdline():
                procs.append(child)
        except psutil.Error:
            pass
    return procs


def _wait_no_workers(timeout: float = 10.0) -> list:
    deadline = time.monotonic() + timeout
    while (left := _worker_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.mark.parametrize("family", list(MODELS))
def test_tp_greedy_matches_hf(tmp_path, family):
    overrides = MODELS[family]
    path = make_tiny_model(tmp_path / family, family, **overrides)
    prompts = _prompts(overrides.get("vocab_size", 512))
    expected = hf_greedy(path, prompts, MAX_TOKENS)
    # Small steps: 100-token prompts are prefilled in chunks; qwen3 also plans ahead; llama's
    # pool holds 24 blocks of 8 (the batch needs ~60), so groups are swapped out and back.
    kw = dict(dtype="float32", block_size=8, max_num_batched_tokens=48, kv_cache_memory=1 << 22)
    tp_kw = dict(kw, tensor_parallel_size=2, async_scheduling=family == "qwen3")
    if family == "llama":
        per_block = 2 * 2 * 8 * 1 * 16 * 4  # K and V, 2 layers, 8 tokens, 1 KV head per rank
        tp_kw.update(kv_cache_memory=24 * per_block, max_model_len=128,
                     preemption_mode="swap", swap_space=0.01)  # fmt: skip
    with LLM(str(path), **tp_kw) as llm:
        if family == "llama":
            assert llm.block_manager.num_blocks == 24
        free_before = llm.block_manager.num_free_blocks
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        # Again: the prompts' full blocks now come from the prefix cache on every rank.
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert sum(o.num_cached_tokens for o in outs) > 0
        assert llm.block_manager.num_free_blocks == free_before
        if family == "llama":
            assert llm.scheduler.num_preemptions > 0
            # n > 1 seeded top-p samples (the logits gathered to rank 0) equal a single rank's.
            params = SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=7, max_tokens=8)
            got = llm.generate(prompts[:2], params, use_tqdm=False)
            want = LLM(str(path), **kw).generate(prompts[:2], params, use_tqdm=False)
            assert [[c.token_ids for c in o.outputs] for o in got] == [
                [c.token_ids for c in o.outputs] for o in want
            ]
            assert len({tuple(c.token_ids) for c in got[0].outputs}) > 1  # the samples differ
    assert _wait_no_workers() == []


def test_tp_samples_vocabulary_shards_as_one_rank_would(tmp_path, monkeypatch):
    """Steps whose rows sample by temperature alone (or greedily) are sampled by each rank
    over its slice of an odd vocabulary; steps with top-p or a min_tokens mask gather the
    logits. Either way the tokens equal a single rank's."""
    import nanopaged.engine.model_runner as model_runner

    path = make_tiny_model(tmp_path / "qwen3", "qwen3", vocab_size=511)
    prompts = _prompts(511, seed=3)
    plain = [SamplingParams(temperature=t, seed=i, max_tokens=12, ignore_eos=True)
             for i, t in enumerate((0.8, 1.0, 0.0, 1.3))]  # fmt: skip
    top_p = SamplingParams(temperature=1.0, top_p=0.8, seed=5, max_tokens=12, ignore_eos=True)
    min_tokens = SamplingParams(temperature=0.9, seed=9, min_tokens=6, max_tokens=12)
    batches = [plain, [plain[0], top_p, plain[2], plain[3]], [plain[1], min_tokens] * 2]
    sharded = []
    real = model_runner.sample_shards
    monkeypatch.setattr(model_runner, "sample_shards",
                        lambda *a: sharded.append(1) or real(*a))  # fmt: skip
    kw = dict(block_size=8, kv_cache_memory=1 << 22)
    got, counts = [], []
    with LLM(str(path), tensor_parallel_size=2, **kw) as llm:
        for params in batches:
            outs = llm.generate(prompts[: len(params)], params, use_tqdm=False)
            got.append([o.outputs[0].token_ids for o in outs])
            counts.append(len(sharded))
    single = LLM(str(path), **kw)
    want = [[o.outputs[0].token_ids for o in single.generate(prompts[: len(p)], p,
                                                            use_tqdm=False)]
            for p in batches]  # fmt: skip
    assert got == want
    assert counts[0] >= 12  # every decode step of the plain batch
    assert counts[1] == counts[0]  # a top-p row in every step: the logits were gathered
    assert counts[1] < counts[2] < counts[1] + 12  # sharded once min_tokens was reached
    assert _wait_no_workers() == []


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama-tp"), "llama")


def test_tp_fp8_cache_matches_one_rank(llama_dir):
    """Each rank quantizes its own KV heads with the same per-layer scales: tp=2 over a tight
    fp8 pool (swapping) gives the tokens of one rank with a large fp8 pool."""
    prompts = _prompts(512)
    kw = dict(block_size=8, kv_cache_dtype="fp8", max_model_len=128, max_num_batched_tokens=48)
    single = LLM(str(llama_dir), kv_cache_memory=1 << 22, **kw)
    want = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY, use_tqdm=False)]
    del single
    per_block = 2 * 2 * 8 * 1 * 16 * 1  # K and V, 2 layers, 8 tokens, 1 KV head, 1 byte
    with LLM(str(llama_dir), tensor_parallel_size=2, kv_cache_memory=24 * per_block,
             preemption_mode="swap", swap_space=0.01, **kw) as llm:  # fmt: skip
        assert llm.block_manager.num_blocks == 24
        assert llm.runner.kv_cache.dtype == torch.float8_e4m3fn
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert got == want
        assert llm.scheduler.num_swap_outs > 0
    assert _wait_no_workers() == []


def test_worker_error_reaches_caller(llama_dir, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "1:2")  # rank 1 raises at its third step
    llm = LLM(str(llama_dir), tensor_parallel_size=2, kv_cache_memory=1 << 22)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="injected fault in tensor-parallel rank 1"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert time.monotonic() - t0 < 15
    assert _wait_no_workers() == []
    with pytest.raises(WorkerError):  # the LLM stays failed, it does not hang
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    llm.shutdown()


def test_workers_end_with_their_llm(llama_dir):
    with LLM(str(llama_dir), tensor_parallel_size=2, kv_cache_memory=1 << 22) as llm:
        assert len(_worker_processes()) >= 1
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert _wait_no_workers() == []
    with pytest.raises(RuntimeError, match="stopped"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    # Dropped without shutdown: the workers go with it, and rank 0's runner, model and KV
    # cache with reference counting alone (a full collection may not come soon, so none of
    # them may sit in a reference cycle).
    llm = LLM(str(llama_dir), tensor_parallel_size=2, kv_cache_memory=1 << 22)
    llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    refs = [weakref.ref(o) for o in (llm.runner, llm.runner.model, llm.runner.kv_cache)]
    gc.disable()
    try:
        del llm
        assert [r() is None for r in refs] == [True] * len(refs)
        assert _wait_no_workers() == []
    finally:
        gc.enable()


def test_workers_exit_when_the_driver_is_killed(llama_dir, tmp_path):
    """A driver killed outright (no atexit, no finalizer) takes its workers with it."""
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "driver.py"
    script.write_text(
        "import multiprocessing as mp, sys, time\n"
        "from nanopaged import LLM\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({str(llama_dir)!r}, tensor_parallel_size=2, kv_cache_memory=1 << 22)\n"
        "    print(*[p.pid for p in mp.active_children()], flush=True)\n"
        "    time.sleep(600)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env,
                              text=True)  # fmt: skip
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert pids
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in pids if _pid_alive(p)]
    assert alive == []


def _pid_alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_unsplittable_shapes_fail_before_starting(llama_dir):
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(str(llama_dir), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(str(llama_dir), tensor_parallel_size=0)
    assert _worker_processes() == []


def test_unknown_start_method_fails_before_starting(llama_dir, monkeypatch):
    monkeypatch.setenv(START_METHOD_ENV, "forkserver")
    with pytest.raises(ValueError, match=f"{START_METHOD_ENV} must be one of fork, spawn"):
        LLM(str(llama_dir), tensor_parallel_size=2, kv_cache_memory=1 << 22)
    assert _worker_processes() == []
    monkeypatch.delenv(START_METHOD_ENV)
    with LLM(str(llama_dir), tensor_parallel_size=2, kv_cache_memory=1 << 22) as llm:
        assert len(llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) > 0


def test_dummy_weights_same_for_any_tp_size(llama_dir):
    """load_format="dummy": one set of random weights from config.json alone, split the way a
    checkpoint would be, so rank 0 of TP=2 holds exactly its slice of TP=1's weights."""
    cfg_only = llama_dir.parent / "llama-config-only"
    cfg_only.mkdir(exist_ok=True)
    (cfg_only / "config.json").write_text((llama_dir / "config.json").read_text())
    kw = dict(load_format="dummy", kv_cache_memory=1 << 22, seed=3)
    whole = LLM(str(cfg_only), **kw).runner.model.model
    with LLM(str(cfg_only), tensor_parallel_size=2, **kw) as llm:
        half = llm.runner.model.model
        emb = whole.embed_tokens.weight
        assert emb.abs().max() <= 1e-3 and emb.std() > 1e-4
        assert torch.equal(half.embed_tokens.weight, emb[:256])
        attn, attn1 = half.layers[1].self_attn, whole.layers[1].self_attn
        d = attn1.head_dim  # 4 query heads, 2 KV heads
        assert torch.equal(attn.o_proj.weight, attn1.o_proj.weight[:, : 2 * d])
        # qkv rows of rank 0: query heads 0-1, then KV head 0 of k and of v
        w, w1 = attn.qkv_proj.weight, attn1.qkv_proj.weight
        assert torch.equal(w[: 2 * d], w1[: 2 * d])
        assert torch.equal(w[2 * d : 3 * d], w1[4 * d : 5 * d])
        assert torch.equal(w[3 * d :], w1[6 * d : 7 * d])
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True),
                           use_tqdm=False)  # fmt: skip
        assert len(out[0].outputs[0].token_ids) == 4
    assert _wait_no_workers() == []


# ---- two GPUs: NCCL, CUDA graphs on ------------------------------------------------------
two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs at least 2 CUDA devices"
)

GPU_SHAPES = {
    "qwen3": dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, vocab_size=1001),
    "llama": dict(hidden_size=512, intermediate_size=1376, num_attention_heads=8,
                  num_key_value_heads=1, num_hidden_layers=3),
}  # fmt: skip


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("family", list(GPU_SHAPES))
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_gpu_tp2_equals_tp1(tmp_path, family, kv_cache_dtype):
    path = make_tiny_model(tmp_path / family, family, **GPU_SHAPES[family])
    vocab = GPU_SHAPES[family].get("vocab_size", 512)
    prompts = _prompts(vocab, seed=1) + [[7] * 33, list(range(3, 60))]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    # Each LLM takes a share of the GPU, so the single-rank one need not be freed first.
    kw = dict(dtype="float32", max_num_seqs=16, max_model_len=512, block_size=16,
              gpu_memory_utilization=0.4, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    single = LLM(str(path), **kw)
    want = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    del single
    gc.collect()
    torch.cuda.empty_cache()
    with LLM(str(path), tensor_parallel_size=2, **kw) as llm:
        assert llm.runner.graphs is not None  # decode replays CUDA graphs holding all-reduces
        # Every LLM of this process sums through peer memory, not only the first.
        assert llm.runner.tp.peer is not None
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
    assert _wait_no_workers() == []


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda_graphs"])
@pytest.mark.parametrize("peer", ["1", "0"], ids=["peer_all_reduce", "nccl_all_reduce"])
def test_gpu_worker_error_reaches_caller(tmp_path, monkeypatch, enforce_eager, peer):
    path = make_tiny_model(tmp_path / "llama", "llama")
    monkeypatch.setenv(FAULT_ENV, "1:3")
    monkeypatch.setenv(PEER_ALL_REDUCE_ENV, peer)
    llm = LLM(str(path), tensor_parallel_size=2, max_num_seqs=8, max_model_len=256,
              gpu_memory_utilization=0.4, enforce_eager=enforce_eager)  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="injected fault"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert time.monotonic() - t0 < 30
    llm.shutdown()
    assert _wait_no_workers() == []


def test_tp_kv_scales_per_rank(llama_dir, tmp_path):
    """Under tensor parallelism every rank takes the checkpoint's KV scales, and with
    calculate_kv_scales each rank calculates its own from its heads' first pass: on the model
    whose K/V are AMPLIFY times larger both give the plain model's tokens (a rank left at 1.0
    would clamp them)."""
    prompts = _prompts(512)
    kw = dict(kv_cache_dtype="fp8", max_model_len=128, kv_cache_memory=1 << 22,
              tensor_parallel_size=2)  # fmt: skip
    scales = {f"model.layers.{i}.self_attn.kv_scale": torch.tensor(AMPLIFY) for i in range(2)}
    runs = {}
    for name, path, calculate in (
        ("plain", llama_dir, False),
        ("checkpoint", amplified_kv(llama_dir, tmp_path / "ckpt", scales), False),
        ("plain calculated", llama_dir, True),
        ("calculated", amplified_kv(llama_dir, tmp_path / "calc"), True),
    ):
        with LLM(str(path), calculate_kv_scales=calculate, **kw) as llm:
            outs = llm.generate(prompts, GREEDY, use_tqdm=False)
            runs[name] = [o.outputs[0].token_ids for o in outs]
            if name == "checkpoint":
                assert (llm.runner.kv_scales == AMPLIFY).all()
    assert runs["checkpoint"] == runs["plain"]
    assert runs["calculated"] == runs["plain calculated"]
    assert _wait_no_workers() == []
