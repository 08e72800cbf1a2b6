"""Where side paths join the engine: stop strings against min_tokens, the iterator over
finished requests, calls from several threads, the caller's heap."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

from nanopaged import LLM, SamplingParams

KV = 1 << 20


@pytest.fixture(scope="module")
def model_dir(byte_llama):
    return byte_llama


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), kv_cache_memory=KV, max_model_len=256)


def _assert_idle(llm: LLM) -> None:
    assert not llm.scheduler.has_unfinished()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_stop_string_inside_min_tokens_does_not_cut(llm):
    tok = llm.get_tokenizer()
    prompts = [[5, 9, 2, 7], [11, 3], [40, 41, 42, 43, 44]]
    free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)  # fmt: skip
    checked = 0
    for prompt, out in zip(prompts, free):
        ids = out.outputs[0].token_ids
        min_tokens = 12
        early = tok.decode(ids[:min_tokens])
        stop = early[1:3] or early  # occurs inside the first min_tokens tokens' text
        p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, min_tokens=min_tokens,
                           stop=[stop])  # fmt: skip
        got = llm.generate([prompt], p, use_tqdm=False)[0].outputs[0]
        full = tok.decode(ids)
        at = full.find(stop, max(0, len(early) - len(stop) + 1))
        if at < 0:  # no later occurrence: the whole output, to max_tokens
            assert got.token_ids == ids and got.text == full and got.finish_reason == "length"
        else:
            assert got.text == full[:at] and got.finish_reason == "stop"
            assert got.stop_reason == stop and len(got.token_ids) > min_tokens
            assert got.token_ids == ids[: len(got.token_ids)]
        assert len(got.text) >= len(early)  # never cut inside the window
        checked += 1
    assert checked == len(prompts)
    _assert_idle(llm)


def test_generate_iter_yields_each_request_as_it_finishes(llm):
    prompts = [[3, 1, 4, 1, 5], [9, 2], [6] * 30, [7, 7, 7]]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (20, 2, 8, 5)]
    want = llm.generate(prompts, params, use_tqdm=False)
    seen = []
    for i, out in llm.generate_iter(prompts, params):
        assert out.finished and out.outputs[0].token_ids == want[i].outputs[0].token_ids
        seen.append(i)
        # Requests still running when one is handed out: the iterator does not wait for all.
        if len(seen) == 1:
            assert llm.scheduler.has_unfinished()
    assert sorted(seen) == [0, 1, 2, 3] and seen[0] == 1 and seen[-1] == 0
    _assert_idle(llm)


def test_generate_iter_checks_first_and_frees_on_break(llm):
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        llm.generate_iter([[1, 2], []])  # before any iteration
    _assert_idle(llm)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    it = llm.generate_iter([[1, 2], [3, 4, 5]], [params, SamplingParams(max_tokens=2)])
    for _i, _out in it:
        with pytest.raises(RuntimeError, match="already running a call in this thread"):
            llm.generate([[1]], use_tqdm=False)
        break
    it.close()
    _assert_idle(llm)
    again = llm.generate([[1, 2]], params, use_tqdm=False)[0]
    assert len(again.outputs[0].token_ids) == 30


def test_threads_get_what_sequential_calls_get(model_dir):
    llm = LLM(str(model_dir), kv_cache_memory=KV, max_model_len=256)
    jobs = [([[i + 1, 2, 3] * (i + 1)], SamplingParams(temperature=1.0, seed=i, max_tokens=12))
            for i in range(6)]  # fmt: skip
    want = [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in jobs]
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(jobs))

    def work(i: int) -> None:
        try:
            start.wait()
            for _ in range(3):
                out = llm.generate(jobs[i][0], jobs[i][1], use_tqdm=False)[0]
                assert got.setdefault(i, out.outputs[0].token_ids) == out.outputs[0].token_ids
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert [got[i] for i in range(len(jobs))] == want
    _assert_idle(llm)


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_caller_objects_stay_collectable(model_dir):
    # A cyclic object the caller holds while an LLM starts is freed once dropped.
    held = _Cycle()
    ref = weakref.ref(held)
    llm = LLM(str(model_dir), kv_cache_memory=KV, max_model_len=256)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    del held
    gc.collect()
    assert ref() is None


def test_best_of_returns_the_n_most_likely_samples(llm):
    prompt = [[4, 8, 15, 16]]
    every = llm.generate(prompt, SamplingParams(n=5, temperature=1.0, seed=3, max_tokens=10,
                                                logprobs=0), use_tqdm=False)[0]  # fmt: skip
    ranked = sorted(every.outputs, key=lambda c: -c.cumulative_logprob)
    p = SamplingParams(n=2, best_of=5, temperature=1.0, seed=3, max_tokens=10)
    best = llm.generate(prompt, p, use_tqdm=False)[0]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in best.outputs] == [0, 1]
    assert all(c.logprobs is None and c.cumulative_logprob is None for c in best.outputs)
    p = SamplingParams(n=2, best_of=5, temperature=1.0, seed=3, max_tokens=10, logprobs=1)
    with_lp = llm.generate(prompt, p, use_tqdm=False)[0]
    assert [c.cumulative_logprob for c in with_lp.outputs] == [
        c.cumulative_logprob for c in ranked[:2]
    ]
    assert p.extra_args is None and SamplingParams(extra_args={"k": 1}).extra_args == {"k": 1}
    with pytest.raises(ValueError, match=r"best_of must be >= n \(3\) or None, got 2"):
        SamplingParams(n=3, best_of=2)
    _assert_idle(llm)
