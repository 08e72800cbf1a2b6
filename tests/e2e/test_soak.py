"""Soak: thousands of short requests with random SamplingParams through one LLM on CPU.

After every call no request is left queued and every KV block is free again; at the end,
resident memory has not grown past warm-up. Bad batches, beam searches and interrupted calls
are mixed in. CI runs a short soak; `NANOPAGED_SOAK=20000 pytest tests/e2e/test_soak.py -s`
runs a long one and prints its numbers.
"""

from __future__ import annotations

import gc
import os
import random
import resource
import time

import pytest
from tiny_models import add_byte_tokenizer, make_tiny_model

from nanopaged import LLM, BeamSearchParams, SamplingParams
from nanopaged.sampling import sampler as sampler_module

NUM_REQUESTS = int(os.environ.get("NANOPAGED_SOAK", "1500"))
MAX_RSS_GROWTH = 50 * 2**20
ALPHABET = "abcdefghij klmnop"


def rss_bytes() -> int:
    """Resident memory now (VmRSS); peak RSS where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _random_params(rng: random.Random) -> SamplingParams:
    max_tokens = rng.randint(1, 8)
    return SamplingParams(
        n=rng.choice([1, 1, 1, 2, 3]),
        temperature=rng.choice([0.0, 0.0, 0.5, 1.0, 1.5]),
        top_p=rng.choice([1.0, 0.9, 0.5]),
        top_k=rng.choice([-1, -1, 1, 5, 50]),
        min_p=rng.choice([0.0, 0.0, 0.1]),
        seed=rng.choice([None, rng.randrange(2**32)]),
        max_tokens=max_tokens,
        min_tokens=rng.randint(0, max_tokens),
        stop=rng.choice([None, None, ["a"], ["b c", "!"], "k"]),
        stop_token_ids=rng.choice([None, [], [rng.randrange(512)]]),
        ignore_eos=rng.random() < 0.5,
        include_stop_str_in_output=rng.random() < 0.5,
        skip_special_tokens=rng.random() < 0.8,
        logprobs=rng.choice([None, None, 0, 2]),
        presence_penalty=rng.choice([0.0, 0.0, 0.5]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3]),
    )


def _random_prompt(rng: random.Random):
    if rng.random() < 0.5:
        return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40)))
    # Shared stems make prefix-cache hits (and evictions) common.
    stem = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20][: rng.randint(0, 16)]
    return stem + [rng.randrange(512) for _ in range(rng.randint(1, 30))]


def _check_outputs(prompts, params, outs) -> None:
    assert len(outs) == len(prompts)
    for p, out in zip(params, outs):
        assert out.finished and len(out.outputs) == p.n
        for c in out.outputs:
            assert 1 <= len(c.token_ids) <= p.max_tokens
            assert c.finish_reason in ("stop", "length")
            assert all(0 <= t < 512 for t in c.token_ids)
            if p.logprobs is not None:
                assert len(c.logprobs) == len(c.token_ids) and c.cumulative_logprob <= 0


def _interrupt_at_sampling_call(monkeypatch, k: int) -> None:
    """Raise KeyboardInterrupt from the k-th sampling call of the runner (either sampler)."""
    left = [k]
    for name in ("sample", "sample_sequences"):
        real = getattr(sampler_module, name)

        def wrapper(*args, _real=real, **kwargs):
            left[0] -= 1
            if left[0] == 0:
                raise KeyboardInterrupt
            return _real(*args, **kwargs)

        monkeypatch.setattr(sampler_module, name, wrapper)


def test_soak(tmp_path_factory, monkeypatch):
    path = make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    add_byte_tokenizer(path)
    # Small enough that long batches preempt; max_model_len caps every request's blocks.
    llm = LLM(str(path), kv_cache_memory=40 * 8192, max_model_len=96, max_num_batched_tokens=256)
    bm = llm.block_manager
    free_at_start = bm.num_free_blocks
    assert free_at_start == bm.num_blocks
    rng = random.Random(1234)
    warmup = max(NUM_REQUESTS // 10, 100)
    rss_start = done = calls = refused = interrupted = beams = 0
    t0 = time.perf_counter()
    while done < NUM_REQUESTS:
        if rss_start == 0 and done >= warmup:
            gc.collect()
            rss_start = rss_bytes()
        calls += 1
        size = rng.randint(1, 32)
        prompts = [_random_prompt(rng) for _ in range(size)]
        params = [_random_params(rng) for _ in range(size)]
        kind = rng.random()
        if kind < 0.03:  # a bad request in the batch: refused before any work
            prompts[rng.randrange(size)] = rng.choice([[], [600], [1] * 97, 3.5])
            with pytest.raises((ValueError, TypeError)):
                llm.generate(prompts, params, use_tqdm=False)
            refused += 1
        elif kind < 0.07:  # Ctrl-C somewhere in the middle
            with monkeypatch.context() as m:
                _interrupt_at_sampling_call(m, rng.randint(1, 6))
                try:
                    llm.generate(prompts, params, use_tqdm=False)
                except KeyboardInterrupt:
                    interrupted += 1
        elif kind < 0.08:
            width = rng.randint(1, 3)
            outs = llm.beam_search(prompts[:4], BeamSearchParams(width, rng.randint(1, 6)),
                                   use_tqdm=False)  # fmt: skip
            assert all(len(o.sequences) == width for o in outs)
            beams += 1
        else:
            _check_outputs(prompts, params, llm.generate(prompts, params, use_tqdm=False))
        done += size
        assert not llm.scheduler.has_unfinished()
        assert bm.num_free_blocks == free_at_start and not any(bm.ref_counts)
        assert bm.cpu_pool.num_free_blocks == bm.cpu_pool.num_blocks
    gc.collect()
    rss_end = rss_bytes()
    elapsed = time.perf_counter() - t0
    print(
        f"\nsoak: {done} requests in {calls} calls ({refused} refused, {interrupted} "
        f"interrupted, {beams} beam searches) in {elapsed:.1f} s; preemptions "
        f"{llm.scheduler.num_preemptions}; free blocks {bm.num_free_blocks}/{bm.num_blocks} "
        f"(start {free_at_start}); RSS after warm-up {rss_start / 2**20:.1f} MiB, end "
        f"{rss_end / 2**20:.1f} MiB ({(rss_end - rss_start) / 2**20:+.1f} MiB)"
    )
    assert llm.scheduler.num_preemptions > 0  # the pool was under pressure
    assert rss_end - rss_start < MAX_RSS_GROWTH
