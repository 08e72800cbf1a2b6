"""Differential fuzz of the whole engine: tight KV pools must give exactly a large pool's output.

Each workload is a random batch of requests through the public API (shared prefixes, greedy,
seeded sampling with n = 1..3, stop strings, EOS, min_tokens, or a beam search) run on an engine
with a pool of a few blocks (preemption by recompute or swap, prefix caching on or off, block
size 8 or 16, chunked prefill or not) and on an engine whose pool never preempts. Seeded samples
do not depend on what else is in the batch, so the two runs must agree token for token, finish
reason for finish reason, and every block must be free afterwards.

`NANOPAGED_FUZZ=N` runs N workloads instead of the default; `NANOPAGED_FUZZ_SEED` picks the
stream of workloads.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, replace

import pytest
import torch
from tiny_models import add_byte_tokenizer, make_tiny_model

from nanopaged import LLM, BeamSearchParams, SamplingParams

NUM_WORKLOADS = int(os.environ.get("NANOPAGED_FUZZ", "400"))
FUZZ_SEED = int(os.environ.get("NANOPAGED_FUZZ_SEED", "0"))
MAX_MODEL_LEN = 64
VOCAB = 512
# A few stems, so prompts of one workload (and of consecutive workloads) share leading blocks.
STEMS = [[], [5, 6, 7, 8, 9, 10, 11, 12], list(range(40, 64)), [3] * 17]


@dataclass(frozen=True)
class EngineKey:
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    preemption_mode: str
    max_num_batched_tokens: int
    kv_cache_dtype: str = "auto"


@dataclass
class Workload:
    key: EngineKey
    prompts: list[list[int]]
    params: list[SamplingParams] | BeamSearchParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("fuzz"), "llama", vocab_size=VOCAB)
    add_byte_tokenizer(path, VOCAB)
    return path


class Engines:
    """One LLM per engine setting, built on first use and reused across workloads."""

    def __init__(self, model_dir) -> None:
        self.model_dir = model_dir
        self.cache: dict[EngineKey, LLM] = {}
        self.block_bytes: dict[tuple[int, str], int] = {}

    def get(self, key: EngineKey) -> LLM:
        if key not in self.cache:
            kind = (key.block_size, key.kv_cache_dtype)
            if kind not in self.block_bytes:
                probe = LLM(str(self.model_dir), block_size=key.block_size, kv_cache_memory=1 << 22,
                            kv_cache_dtype=key.kv_cache_dtype)  # fmt: skip
                self.block_bytes[kind] = probe.runner.kv_bytes_per_block
            self.cache[key] = LLM(
                str(self.model_dir),
                block_size=key.block_size,
                kv_cache_memory=key.num_blocks * self.block_bytes[kind],
                kv_cache_dtype=key.kv_cache_dtype,
                enable_prefix_caching=key.enable_prefix_caching,
                preemption_mode=key.preemption_mode,
                swap_space=0.01,
                max_num_batched_tokens=key.max_num_batched_tokens,
                max_model_len=MAX_MODEL_LEN,
                max_num_seqs=8,
            )
            assert self.cache[key].block_manager.num_blocks == key.num_blocks
        return self.cache[key]

    def reference(self, key: EngineKey) -> LLM:
        """Room for every request of a workload at once: nothing is ever preempted."""
        blocks = 8 * -(-MAX_MODEL_LEN // key.block_size)  # max_num_seqs full-length sequences
        return self.get(
            EngineKey(key.block_size, blocks, False, "recompute", 4096, key.kv_cache_dtype)
        )


@pytest.fixture(scope="module")
def engines(model_dir):
    # Steps of a tiny model are too small for several threads to pay off.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Engines(model_dir)
    torch.set_num_threads(threads)


def _prompt(rng: random.Random) -> list[int]:
    stem = rng.choice(STEMS)
    return stem + [rng.randrange(VOCAB) for _ in range(rng.randint(1 if stem else 1, 14))]


def _fit(rng: random.Random, prompt: list[int], width: int, key: EngineKey) -> int | None:
    """A max_tokens for which `width` sequences of this prompt fit the pool alone.

    Half the time it ends the sequence just past a block boundary: its computed tokens then
    fill whole blocks, all of them cached, so finishing frees no uncached block to be handed
    out first, and cached blocks of other sequences are next in line (where preempted groups
    coming back used to collide).
    """
    for _ in range(8):
        max_tokens = rng.randint(1, 24)
        if rng.random() < 0.5:
            aligned = max_tokens - (len(prompt) + max_tokens - 1) % key.block_size
            max_tokens = aligned if aligned >= 1 else max_tokens
        total = min(len(prompt) + max_tokens, MAX_MODEL_LEN)
        if width * -(-total // key.block_size) <= key.num_blocks:
            return max_tokens
    return None


def _sampling(rng: random.Random, prompt: list[int], key: EngineKey, tok) -> SamplingParams | None:
    n = rng.choice([1, 2, 2, 3])
    max_tokens = _fit(rng, prompt, n, key)
    if max_tokens is None:
        return None
    greedy = n == 1 and rng.random() < 0.4
    stop = None
    if rng.random() < 0.3:  # a one- or two-character piece of some token's text
        text = tok.decode([rng.randrange(256)]) + tok.decode([rng.randrange(VOCAB)])
        stop = [text[: rng.randint(1, 2)]]
    return SamplingParams(
        n=n,
        temperature=0.0 if greedy else rng.choice([0.7, 1.0, 1.3]),
        top_p=rng.choice([1.0, 1.0, 0.9]),
        top_k=rng.choice([-1, -1, 20]),
        seed=None if greedy else rng.randrange(2**32),
        max_tokens=max_tokens,
        min_tokens=rng.choice([0, 0, min(2, max_tokens)]),
        ignore_eos=rng.random() < 0.5,
        stop=stop,
    )


def random_workload(rng: random.Random, tok) -> Workload:
    if rng.random() < 0.5:
        key = _random_engine(rng)
    else:
        # Preempted groups recomputed with prefix caching in the smallest pools: the setting
        # where a group coming back competes with its own cached blocks.
        key = EngineKey(8, rng.choice([8, 9, 10, 12]), True, "recompute", 512)
    return _random_requests(rng, tok, key)


def _random_engine(rng: random.Random) -> EngineKey:
    block_size = rng.choice([8, 16])
    num_blocks = rng.choice([8, 10, 12, 16]) if block_size == 8 else rng.choice([4, 5, 6, 8])
    return EngineKey(
        block_size=block_size,
        num_blocks=num_blocks,
        enable_prefix_caching=rng.random() < 0.6,
        preemption_mode=rng.choice(["recompute", "swap"]),
        max_num_batched_tokens=rng.choice([16, 512]),
    )


def _random_requests(rng: random.Random, tok, key: EngineKey) -> Workload:
    if rng.random() < 0.2:
        width = rng.choice([2, 3])
        prompts, max_tokens = [], 16
        for _ in range(rng.randint(1, 3)):
            prompt = _prompt(rng)
            m = _fit(rng, prompt, 2 * width, key)  # a beam step holds up to 2x the live beams
            if m is not None:
                prompts.append(prompt)
                max_tokens = min(max_tokens, m)
        if prompts:
            return Workload(key, prompts, BeamSearchParams(beam_width=width, max_tokens=max_tokens))
    prompts, params = [], []
    for _ in range(rng.randint(2, 6)):
        prompt = _prompt(rng)
        p = _sampling(rng, prompt, key, tok)
        if p is not None:
            prompts.append(prompt)
            params.append(p)
    if not prompts:
        prompts, params = [[1]], [SamplingParams(temperature=0, max_tokens=4)]
    return Workload(key, prompts, params)


def run(llm: LLM, w: Workload) -> list:
    """The observable result of a workload: tokens, finish and stop reasons of every output."""
    if isinstance(w.params, BeamSearchParams):
        outs = llm.beam_search(w.prompts, w.params, use_tqdm=False)
    else:
        outs = llm.generate(w.prompts, w.params, use_tqdm=False)
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "a block is still held after the workload"
    assert bm.cpu_pool.num_free_blocks == bm.cpu_pool.num_blocks
    assert not llm.scheduler.has_unfinished()
    if isinstance(w.params, BeamSearchParams):
        return [[(s.tokens, s.text, s.finish_reason) for s in o.sequences] for o in outs]
    return [
        [(c.index, c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in o.outputs]
        for o in outs
    ]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_tight_pools_match_a_large_pool(engines, model_dir, kv_cache_dtype):
    """The workloads on caches in the model's dtype, and a quarter of them on 8-bit caches."""
    rng = random.Random(FUZZ_SEED)
    tok = engines.reference(EngineKey(8, 8, False, "recompute", 16)).tokenizer
    failures = []
    preemptions = swaps = 0
    num_workloads = NUM_WORKLOADS if kv_cache_dtype == "auto" else max(1, NUM_WORKLOADS // 4)
    for i in range(num_workloads):
        w = random_workload(rng, tok)
        w.key = replace(w.key, kv_cache_dtype=kv_cache_dtype)
        tight = engines.get(w.key)
        before = (tight.scheduler.num_preemptions, tight.scheduler.num_swap_outs)
        try:
            got = run(tight, w)
        except Exception as e:  # noqa: BLE001 - every failure is collected and reported
            failures.append((i, w, f"{type(e).__name__}: {e}"))
            continue
        preemptions += tight.scheduler.num_preemptions - before[0]
        swaps += tight.scheduler.num_swap_outs - before[1]
        reference = engines.reference(w.key)
        want = run(reference, w)
        assert reference.scheduler.num_preemptions == 0
        if got != want:
            failures.append((i, w, "outputs differ from the large pool's"))
    # The workloads must actually exercise preemption, or this test proves nothing.
    assert preemptions > num_workloads // 4 and swaps > num_workloads // 20, (preemptions, swaps)
    assert not failures, f"{len(failures)} of {num_workloads} failed; first: {failures[0]}"
