"""Asynchronous scheduling (step N+1 planned before step N's samples arrive) changes nothing.

Every LLM here runs on the CPU, also on a machine with a GPU: these tests compare outputs
token for token across runs whose batches and cached prefixes differ, which the CPU path
computes bit for bit alike and the GPU kernels need not (their sums follow the batch's shape);
tests/e2e/test_gpu.py covers asynchronous scheduling on CUDA."""

from __future__ import annotations

import json
import random

import pytest
from tiny_models import add_byte_tokenizer, hf_greedy, make_tiny_model

from nanopaged import LLM, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2")
    add_byte_tokenizer(path)
    return path


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randint(1, 60))] for _ in range(n)]


def _run(path, async_scheduling: bool, prompts, params, **kw):
    llm = LLM(str(path), kv_cache_memory=1 << 22, async_scheduling=async_scheduling,
              device="cpu", dtype="float32", **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert not llm.scheduler.has_unfinished()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert (llm.scheduler.num_advanced_steps > 0) == async_scheduling
    return llm, [o.outputs[0] for o in outs]


def test_greedy_equals_hf_with_lookahead(model_dir):
    prompts = _prompts(10, seed=0)
    expected = hf_greedy(model_dir, prompts, 25)
    # Staggered lengths: sequences finish at different steps while later ones are in flight.
    params = [SamplingParams(temperature=0, max_tokens=5 + 2 * i, ignore_eos=True)
              for i in range(len(prompts))]  # fmt: skip
    _, outs = _run(model_dir, True, prompts, params, max_num_batched_tokens=64)
    assert [o.token_ids for o in outs] == [e[: 5 + 2 * i] for i, e in enumerate(expected)]


def test_seeded_sampling_and_eos_match_sync(model_dir, tmp_path):
    """EOS seen one step late in async mode still ends the sequence at the same token."""
    prompts = _prompts(12, seed=1)
    params = [SamplingParams(temperature=0.9, top_k=40, seed=i, max_tokens=30)
              for i in range(len(prompts))]  # fmt: skip
    # An EOS the model actually emits: the most common token of a probe run.
    _, probe = _run(model_dir, False, prompts, params)
    counts: dict[int, int] = {}
    for o in probe:
        for t in o.token_ids[3:]:
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=counts.get)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((model_dir / name).read_text())
        cfg["eos_token_id"] = eos
        (tmp_path / name).write_text(json.dumps(cfg))
    for f in model_dir.iterdir():
        if not (tmp_path / f.name).exists():
            (tmp_path / f.name).symlink_to(f)
    _, sync = _run(tmp_path, False, prompts, params)
    llm, lookahead = _run(tmp_path, True, prompts, params)
    assert [o.token_ids for o in lookahead] == [o.token_ids for o in sync]
    assert [o.finish_reason for o in lookahead] == [o.finish_reason for o in sync]
    assert any(o.finish_reason == "stop" for o in sync)
    assert all(-1 not in o.token_ids for o in lookahead)
    # The LLM stays usable: a second generate gives the same again.
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.token_ids for o in sync]


def test_mixed_features_fall_back_to_sync(model_dir):
    """Stop strings, n > 1 and logprobs take the synchronous path inside an async engine;
    once those requests end, the plain ones go on asynchronously."""
    prompts = _prompts(4, seed=2)
    params = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, stop=["\x00"]),
        SamplingParams(temperature=0.8, n=2, seed=3, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2),
    ]
    _, sync = _run(model_dir, False, prompts, params)
    _, lookahead = _run(model_dir, True, prompts, params)
    assert [o.token_ids for o in lookahead] == [o.token_ids for o in sync]


def test_stop_strings_and_forked_samples_run_ahead(model_dir):
    """Stop strings are checked as samples arrive and n > 1 samples after their fork are plain
    rows: both run asynchronously and give exactly the synchronous outputs."""
    prompts = _prompts(6, seed=4)
    llm0 = LLM(str(model_dir), kv_cache_memory=1 << 22, device="cpu")
    # Stop strings taken from the greedy continuations, so several of them do match.
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    texts = [o.outputs[0].text for o in llm0.generate(prompts, greedy, use_tqdm=False)]
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[t[5:7] or "zz"])
        for t in texts[:3]
    ] + [
        SamplingParams(temperature=0.9, n=3, seed=9 + i, max_tokens=20, ignore_eos=True,
                       stop=["q"], include_stop_str_in_output=True)
        for i in range(3)
    ]  # fmt: skip
    _, sync = _run(model_dir, False, prompts, params)
    llm, _ = _run(model_dir, True, prompts, params)
    lookahead = llm.generate(prompts, params, use_tqdm=False)
    sync_llm = LLM(str(model_dir), kv_cache_memory=1 << 22, async_scheduling=False, device="cpu")
    sync_all = [
        [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
        for o in sync_llm.generate(prompts, params, use_tqdm=False)
    ]
    got = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
           for o in lookahead]  # fmt: skip
    assert got == sync_all
    assert sum(c[2] == "stop" for o in got for c in o) >= 3
    # Most steps ran ahead: only the prefill and the fork steps wait for their samples.
    assert llm.scheduler.num_advanced_steps >= 10


def test_logprobs_run_ahead_and_equal_sync(model_dir):
    """Raw logprobs come back with the tokens of a plain step, so logprobs requests run
    asynchronously; they equal the synchronous run's (ids, values and ranks)."""
    prompts = _prompts(5, seed=6)
    params = [
        SamplingParams(temperature=0.7, seed=i, max_tokens=12, ignore_eos=True, logprobs=k)
        for i, k in enumerate([0, 1, 3, 5, None])
    ]

    def run(async_scheduling):
        llm = LLM(str(model_dir), kv_cache_memory=1 << 22, async_scheduling=async_scheduling,
                  device="cpu")
        outs = llm.generate(prompts, params, use_tqdm=False)
        return llm, [
            (c.token_ids, c.cumulative_logprob,
             c.logprobs and [{t: (round(v.logprob, 5), v.rank) for t, v in d.items()}
                             for d in c.logprobs])
            for o in outs for c in o.outputs
        ]  # fmt: skip

    _, sync = run(False)
    llm, ahead = run(True)
    assert [a[0] for a in ahead] == [s[0] for s in sync]
    assert [a[2] for a in ahead] == [s[2] for s in sync]
    for (_, a, _), (_, s, _) in zip(ahead, sync):
        assert (a is None) == (s is None) and (a is None or abs(a - s) < 1e-4)
    assert llm.scheduler.num_advanced_steps >= 8
    # Each token's entry: the top-k asked for plus the sampled token, ranked from 1.
    for (tokens, _, lps), p in zip(sync, params):
        if p.logprobs is None:
            assert lps is None
            continue
        for t, d in zip(tokens, lps):
            assert t in d and len(d) in (p.logprobs, p.logprobs + 1)
            assert sorted(r for _, r in d.values())[: p.logprobs] == list(range(1, p.logprobs + 1))


def test_penalties_run_ahead(model_dir):
    """Presence, frequency and repetition penalties are plain rows: their steps run ahead,
    counting the token still in flight from the device, and give exactly the synchronous
    tokens, also when a later request makes a step synchronous (a fork, penalties with
    logprobs) while penalized rows have a token in flight."""
    prompts = _prompts(7, seed=5)
    pen = dict(presence_penalty=0.7, frequency_penalty=0.9, repetition_penalty=1.6)
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **pen),
        SamplingParams(temperature=0.9, seed=11, max_tokens=30, ignore_eos=True, **pen),
        SamplingParams(temperature=0.8, seed=12, max_tokens=18, ignore_eos=True,
                       repetition_penalty=0.7),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, frequency_penalty=-1.5),
        SamplingParams(temperature=0.9, n=2, seed=13, max_tokens=10, ignore_eos=True, **pen),
        SamplingParams(temperature=0.7, seed=14, max_tokens=12, ignore_eos=True, logprobs=2,
                       **pen),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **pen),
    ]  # fmt: skip
    # Three sequences at a time: the later requests join (and fork) while others decode.
    kw = dict(max_num_seqs=3)
    _, sync = _run(model_dir, False, prompts, params, **kw)
    llm, lookahead = _run(model_dir, True, prompts, params, **kw)
    assert [o.token_ids for o in lookahead] == [o.token_ids for o in sync]
    # The logprobs row (synchronous, raw logprobs beside penalized draws): the same tokens and
    # ranks, values within float noise (its batches differ between the two runs).
    for a, b in zip(lookahead[5].logprobs, sync[5].logprobs, strict=True):
        assert {t: x.rank for t, x in a.items()} == {t: x.rank for t, x in b.items()}
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    # The penalties did change the tokens (greedy rows against the same rows without them).
    plain = LLM(str(model_dir), kv_cache_memory=1 << 22, device="cpu").generate(
        [prompts[0], prompts[3]],
        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (24, 20)],
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in plain] != [sync[0].token_ids, sync[3].token_ids]
    steps = llm.scheduler.num_steps
    assert llm.scheduler.num_advanced_steps >= steps // 2, (llm.scheduler.num_advanced_steps, steps)
    # The counts stayed on the device: each sequence's row was built from its token lists once
    # (7 requests, one of them n=2), every later step added only its newest token.
    counts = llm.runner.sampler.penalty_counts
    assert counts is not None and counts.num_rebuilt <= 8, counts.num_rebuilt


def test_start_up_prefill_passes_change_nothing(model_dir):
    """The dummy prefill passes a GPU engine runs at start-up (ModelRunner._compile_prefill,
    run here on the CPU path, where start-up skips them) leave every block zeroed, and the
    engine's outputs equal HF's after them: short, mixed, long and prefix cases alike."""
    prompts = _prompts(6, seed=3)
    expected = hf_greedy(model_dir, prompts, 12)
    llm = LLM(str(model_dir), kv_cache_memory=1 << 22, device="cpu", dtype="float32",
              max_model_len=1024)  # fmt: skip
    runner = llm.llm_engine.runner
    forwards = []
    forward = runner._forward_eager
    runner._forward_eager = lambda step, pending: forwards.append(step) or forward(step, pending)
    runner._compile_prefill()
    assert [list(s.cu_seqlens_q) for s in forwards] == [[0, 5, 22], [0, 1, 18], [0, 520],
                                                        [0, 520]]  # fmt: skip
    assert int(runner.kv_cache.count_nonzero()) == 0
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)  # fmt: skip
    assert [o.outputs[0].token_ids for o in outs] == expected
