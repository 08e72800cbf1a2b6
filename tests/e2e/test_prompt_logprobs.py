"""Prompt logprobs come from the prefill steps' own logits rows: they equal HF transformers'
log_softmax of the prompt's logits under chunked prefill, prefix caching, preemption (recompute
and swap), n > 1, asynchronous scheduling, mixed batches and tensor parallelism, and each
prompt position is scored once."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from tiny_models import make_tiny_model

import nanopaged.engine.kv_cache as kv_cache
import nanopaged.engine.model_runner as model_runner
from nanopaged import LLM, SamplingParams
from nanopaged.engine.step_inputs import StepInputs
from nanopaged.sampling import prompt_logprobs

LENGTHS = (1, 2, 9, 40, 100)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def hf(llama):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()


@pytest.fixture
def scored_rows(monkeypatch):
    """The number of prompt rows each step scored, in order (rank 0 of this process)."""
    counts: list[int] = []
    real = model_runner.score_prompt_rows

    def spy(compute_logits, hidden, rows, *args):
        counts.append(len(rows))
        return real(compute_logits, hidden, rows, *args)

    monkeypatch.setattr(model_runner, "score_prompt_rows", spy)
    monkeypatch.setattr(kv_cache, "score_prompt_rows", spy)  # the memory profile's chunk
    return counts


def _prompts(lengths, seed: int, vocab: int = 512) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def _reference(hf, prompt: list[int]) -> torch.Tensor:
    """HF's logprobs of every prompt position but the last: [len - 1, vocab]."""
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)


def _check(out, prompt: list[int], k: int | None, ref: torch.Tensor, tol: float = 1e-4) -> None:
    """out.prompt_logprobs: None when not asked; else [None, *entries], entry j holding the
    top-k of HF's row j - 1 (ranked 1..k, best first) and prompt token j with its own rank."""
    got = out.prompt_logprobs
    if k is None:
        assert got is None
        return
    assert got[0] is None and len(got) == len(prompt)
    for j in range(1, len(prompt)):
        entry, row, token = got[j], ref[j - 1], prompt[j]
        top = row.topk(k).indices.tolist() if k else []
        assert list(entry) == top + ([] if token in top else [token]), j
        assert [entry[t].rank for t in top] == list(range(1, k + 1)), j
        assert entry[token].rank == int((row > row[token]).sum()) + 1, j
        want = row[list(entry)]
        assert [e.logprob for e in entry.values()] == pytest.approx(want.tolist(), abs=tol), j


def _asked(params: list[SamplingParams], prompts: list[list[int]]) -> int:
    """Prompt positions the requests asking for prompt logprobs have to score."""
    return sum(len(q) - 1 for p, q in zip(params, prompts) if p.prompt_logprobs is not None)


@pytest.mark.parametrize(
    "engine",
    [
        dict(),
        dict(max_num_batched_tokens=16),  # 40- and 100-token prompts prefill in chunks
        dict(max_num_batched_tokens=24, async_scheduling=True),  # steps planned ahead
        dict(rows_per_chunk=5),  # a step's prompt rows are scored 5 at a time
    ],
    ids=["one-step", "chunked", "async", "row-chunks"],
)
def test_prompt_logprobs_equal_hf(llama, hf, scored_rows, monkeypatch, engine):
    """A mixed batch: prompts of several lengths asking for 0, 1, 3 and 5 top logprobs, or
    none; each position is scored once, only for the requests that ask."""
    engine = dict(engine)
    if "rows_per_chunk" in engine:
        rows = engine.pop("rows_per_chunk")
        monkeypatch.setattr(prompt_logprobs, "CHUNK_BYTES", 4 * (512 + 5) * rows)
        assert prompt_logprobs.rows_per_chunk(512, 3) == prompt_logprobs.rows_per_chunk(512, 5)
        assert prompt_logprobs.rows_per_chunk(512, 5) == rows
    llm = LLM(str(llama), device="cpu", dtype="float32", block_size=8, kv_cache_memory=1 << 22,
              **engine)
    prompts = _prompts(LENGTHS, seed=1) + _prompts((30, 70), seed=2)
    ks = [3, 0, 1, 5, 3, None, 2]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=k)
              for k in ks]  # fmt: skip
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, prompt, k in zip(outs, prompts, ks):
        _check(out, prompt, k, _reference(hf, prompt))
    assert sum(scored_rows) == _asked(params, prompts)
    if "max_num_batched_tokens" in engine:
        assert len([n for n in scored_rows if n]) > 2  # prompts scored over several steps
    if engine.get("async_scheduling"):
        assert llm.scheduler.num_advanced_steps > 0
    # The same tokens as without prompt logprobs.
    plain = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * len(prompts)
    again = llm.generate(prompts, plain, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]


def test_cached_prefix_is_computed_again_and_published(llama, hf, scored_rows):
    """A request asking for prompt logprobs takes no prefix-cache hits (it needs every
    position's logits), yet the blocks it computes serve later requests."""
    llm = LLM(str(llama), device="cpu", dtype="float32", block_size=8, kv_cache_memory=1 << 22)
    base, tail, fresh = _prompts((40, 13, 37), seed=3)
    greedy = SamplingParams(temperature=0, max_tokens=4)
    assert llm.generate([base], greedy, use_tqdm=False)[0].num_cached_tokens == 0
    scored = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
    outs = llm.generate([base + tail, fresh], scored, use_tqdm=False)
    _check(outs[0], base + tail, 2, _reference(hf, base + tail))
    _check(outs[1], fresh, 2, _reference(hf, fresh))
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert sum(scored_rows) == len(base + tail) - 1 + len(fresh) - 1
    # The blocks the scored requests computed were published to the cache.
    again = llm.generate([base + tail, fresh], greedy, use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [48, 32]
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_score_each_position_once(llama, hf, scored_rows, mode):
    """A tight pool preempts groups mid-prefill and mid-decode (n = 2 samples among them):
    a recomputed prefill scores none of the positions its first pass recorded."""
    per_block = 2 * 2 * 8 * 2 * 16 * 4  # K and V, 2 layers, 8 tokens, 2 KV heads, fp32
    llm = LLM(str(llama), device="cpu", dtype="float32", block_size=8, max_model_len=128,
              kv_cache_memory=20 * per_block, max_num_batched_tokens=32, preemption_mode=mode,
              swap_space=64 * per_block / 2**30)  # fmt: skip
    assert llm.block_manager.num_blocks == 20
    prompts = _prompts((40, 60, 50, 30, 45), seed=4)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=k)
              for k in (2, 1, None, 3)]  # fmt: skip
    params.append(SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=24, ignore_eos=True,
                                 prompt_logprobs=2))  # fmt: skip
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    assert (llm.scheduler.num_swap_outs > 0) == (mode == "swap")
    for out, prompt, p in zip(outs, prompts, params):
        _check(out, prompt, p.prompt_logprobs, _reference(hf, prompt))
    assert sum(scored_rows) == _asked(params, prompts)
    assert llm.block_manager.num_free_blocks == 20


def test_parallel_samples_score_the_prompt_once(llama, hf, scored_rows):
    prompt = _prompts((33,), seed=6)[0]
    p = SamplingParams(n=4, temperature=1.0, seed=2, max_tokens=8, prompt_logprobs=3)
    llm = LLM(str(llama), device="cpu", dtype="float32", block_size=8, kv_cache_memory=1 << 22)
    (out,) = llm.generate([prompt], p, use_tqdm=False)
    assert len(out.outputs) == 4 and len({tuple(c.token_ids) for c in out.outputs}) > 1
    _check(out, prompt, 3, _reference(hf, prompt))
    assert scored_rows.count(0) + scored_rows.count(len(prompt) - 1) == len(scored_rows)
    assert sum(scored_rows) == len(prompt) - 1


def test_step_inputs_carry_the_prompt_rows():
    """Every tensor-parallel rank gets the prompt rows, their targets and top-k widths."""
    step = StepInputs(
        input_ids=np.arange(7), positions=np.arange(7), slots=np.arange(7),
        tables=np.zeros((2, 1), dtype=np.int32), context_lens=np.array([4, 3], dtype=np.int32),
        cu_seqlens_q=np.array([0, 4, 7], dtype=np.int32), logits_indices=np.array([3]),
        blocks_to_swap_out=[], blocks_to_swap_in=[], blocks_to_copy=[],
        pending_dst=np.zeros(0, dtype=np.int64), pending_src=np.zeros(0, dtype=np.int64),
        prompt_rows=np.array([0, 1, 2, 4, 5]), prompt_targets=np.array([9, 8, 7, 6, 5]),
        prompt_topk=np.array([2, 2, 2, 0, 0]),
    )  # fmt: skip
    back = StepInputs.unpack(step.pack())
    for name in ("prompt_rows", "prompt_targets", "prompt_topk", "logits_indices"):
        assert np.array_equal(getattr(back, name), getattr(step, name)), name


TP_SCRIPT = """
import json, sys
from nanopaged import LLM, SamplingParams

if __name__ == "__main__":
    path, device, prompts, ks = json.loads(sys.argv[1])
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=k)
              for k in ks]
    with LLM(path, device=device, dtype="float32", tensor_parallel_size=2, block_size=8,
             max_num_batched_tokens=24, kv_cache_memory=1 << 22, async_scheduling=True) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    print(json.dumps([
        None if o.prompt_logprobs is None else
        [[[t, lp.logprob, lp.rank] for t, lp in e.items()] for e in o.prompt_logprobs[1:]]
        for o in outs
    ]))
"""


def _entries(out) -> list | None:
    if out.prompt_logprobs is None:
        return None
    return [[[t, lp.logprob, lp.rank] for t, lp in e.items()] for e in out.prompt_logprobs[1:]]


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, TWO_GPUS])])
def test_tensor_parallel_prompt_logprobs_equal_one_rank(llama, tmp_path, device):
    """tensor_parallel_size=2 (gloo on CPU): every rank runs the prompt rows' logits (a
    collective gather each chunk), so nothing waits forever; the entries equal a single
    rank's. Run in a child process under a timeout, so a hang fails the test instead of the
    run."""
    prompts = _prompts((40, 9, 1, 70), seed=7)
    ks = [2, None, 1, 4]
    script = tmp_path / "tp.py"
    script.write_text(TP_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    try:
        run = subprocess.run(
            [sys.executable, str(script), json.dumps([str(llama), device, prompts, ks])],
            capture_output=True, text=True, timeout=150, env=env,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("tensor_parallel_size=2 with prompt_logprobs did not finish in 150 s")
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=k)
              for k in ks]  # fmt: skip
    one = LLM(str(llama), device=device, dtype="float32", block_size=8,
              max_num_batched_tokens=24, kv_cache_memory=1 << 22)  # fmt: skip
    want = [_entries(o) for o in one.generate(prompts, params, use_tqdm=False)]
    assert [g is None for g in got] == [k is None for k in ks]
    tol = 1e-4 if device == "cpu" else 1e-3
    for g, w in zip(got, want):
        if w is None:
            continue
        assert len(g) == len(w)
        for ge, we in zip(g, w):
            assert [[t, r] for t, _, r in ge] == [[t, r] for t, _, r in we]
            assert [lp for _, lp, _ in ge] == pytest.approx([lp for _, lp, _ in we], abs=tol)


@pytest.mark.gpu
def test_gpu_prompt_logprobs_equal_hf(llama, hf, scored_rows):
    """On CUDA (fp32, decode graphs, asynchronous steps, chunked prefill): the memory profile
    scores a chunk of prompt rows like a step does, and the entries equal HF's."""
    llm = LLM(str(llama), device="cuda", dtype="float32", block_size=8,
              max_num_batched_tokens=24, gpu_memory_utilization=0.3)  # fmt: skip
    assert scored_rows, "the memory profile scored no prompt rows"
    scored_rows.clear()
    prompts = _prompts(LENGTHS, seed=8)
    ks = [1, 3, None, 2, 5]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=k)
              for k in ks]  # fmt: skip
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, prompt, k in zip(outs, prompts, ks):
        _check(out, prompt, k, _reference(hf, prompt), tol=1e-3)
    assert sum(scored_rows) == _asked(params, prompts)
