"""Sharing end to end on tiny HF models: parallel samples, beam search against a plain reference
over HF logits, swap preemption, logprobs and penalties against HF."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import torch
import transformers
from tiny_models import add_byte_tokenizer, make_tiny_model

from nanopaged import LLM, BeamSearchParams, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(lengths, seed) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def hf_model(llama):
    return transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()


@torch.no_grad()
def _hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab]: HF's log_softmax of the next-token logits at each position."""
    return model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


# ---- parallel sampling ---------------------------------------------------------------------
def test_parallel_samples_differ_and_reproduce(llama):
    llm = LLM(str(llama), dtype="float32", kv_cache_memory=1 << 22, block_size=8)
    prompt = _prompts([21], seed=0)[0]
    p = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True)
    out = llm.generate([prompt], p, use_tqdm=False)[0]
    samples = [c.token_ids for c in out.outputs]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(s) for s in samples}) == 4
    assert all(c.cumulative_logprob is None and c.logprobs is None for c in out.outputs)
    other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    crowd = llm.generate([[7] * 30, prompt, [1, 2]], [other, p, other], use_tqdm=False)
    assert [c.token_ids for c in crowd[1].outputs] == samples
    # Sample 0 is what n = 1 with the same seed draws.
    single = llm.generate([prompt], replace(p, n=1), use_tqdm=False)[0]
    assert single.outputs[0].token_ids == samples[0]
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_each_sample_stops_on_its_own(tmp_path):
    """Stop strings and EOS end one sample of a group; its siblings run on."""
    path = make_tiny_model(tmp_path / "llama", "llama")
    add_byte_tokenizer(path)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=1 << 22, block_size=8)
    p = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)
    full = llm.generate("hello", p, use_tqdm=False)[0].outputs
    stop = full[1].text[6:8]
    stopped = llm.generate("hello", replace(p, stop=[stop]), use_tqdm=False)[0].outputs
    for f, c in zip(full, stopped):
        cut = f.text.find(stop)
        if cut < 0:
            assert (c.text, c.finish_reason) == (f.text, "length")
        else:
            assert c.text == f.text[:cut] and c.finish_reason == "stop"
            assert c.token_ids == f.token_ids[: len(c.token_ids)]
    assert stopped[1].finish_reason == "stop"
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_samples_share_the_prompt_blocks(llama):
    """Peak blocks of n=6 are 6x those of n=1 less 5 copies of the prompt's full blocks."""
    llm = LLM(str(llama), dtype="float32", kv_cache_memory=1 << 22, block_size=8)
    prompt = _prompts([45], seed=1)[0]  # 5 full blocks of 8 and a partial one
    peaks = {}
    for n in (1, 6):
        p = SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=20, ignore_eos=True)
        llm.generate([prompt], p, use_tqdm=False)
        peaks[n] = llm.kv_stats().peak_used_blocks
    assert peaks[1] == -(-(45 + 19) // 8)  # the last sampled token is never computed
    assert 6 * peaks[1] - peaks[6] == 5 * (45 // 8)
    assert llm.kv_stats().peak_shared_blocks == 45 // 8 + 1


# ---- beam search ---------------------------------------------------------------------------
@torch.no_grad()
def _reference_beam_search(model, prompt, width, max_tokens, eos, ignore_eos, length_penalty):
    """Beam search written plainly over HF's full-sequence logits."""
    beams = [(list(prompt), 0.0)]
    done = []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in beams:
            values, ids = _hf_logprobs(model, tokens)[-1].topk(2 * width)
            for v, t in zip(values.tolist(), ids.tolist()):
                if t in eos and not ignore_eos:
                    done.append((tokens + [t], cum + v, True))
                else:
                    candidates.append((tokens + [t], cum + v))
        candidates.sort(key=lambda c: c[1], reverse=True)
        beams = candidates[:width]
    done += [(tokens, cum, False) for tokens, cum in beams]

    def score(c):
        length = len(c[0]) - (1 if c[2] else 0)
        return c[1] / length**length_penalty

    done.sort(key=score, reverse=True)
    return [(tokens[len(prompt) :], cum) for tokens, cum, _ in done[:width]]


@pytest.fixture(scope="module")
def beam_model(tmp_path_factory, hf_model):
    """The llama model with EOS set to a token beams meet: the prompt's second-best next token."""
    path = make_tiny_model(tmp_path_factory.mktemp("beam"), "llama")
    eos = _hf_logprobs(hf_model, BEAM_PROMPTS[0])[-1].topk(2).indices[1].item()
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((path / name).read_text())
        cfg["eos_token_id"] = eos
        (path / name).write_text(json.dumps(cfg))
    return path, eos


BEAM_PROMPTS = _prompts([13, 5], seed=4)


@pytest.mark.parametrize(
    "length_penalty, ignore_eos, device",
    [
        (1.0, False, "cpu"),
        (0.5, True, "cpu"),
        pytest.param(1.0, False, "cuda", marks=pytest.mark.gpu),
    ],
)
def test_beam_search_equals_reference(beam_model, hf_model, length_penalty, ignore_eos, device):
    path, eos = beam_model
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=ignore_eos,
                              length_penalty=length_penalty)  # fmt: skip
    llm = LLM(str(path), kv_cache_memory=1 << 22, block_size=8, device=device, dtype="float32")
    outs = llm.beam_search(BEAM_PROMPTS, params, use_tqdm=False)
    # The peak is reached while it runs: forked beams hold the prompt's blocks together.
    assert llm.kv_stats().peak_shared_blocks > 0
    for prompt, out in zip(BEAM_PROMPTS, outs):
        expected = _reference_beam_search(hf_model, prompt, 3, 8, {eos}, ignore_eos,
                                          length_penalty)  # fmt: skip
        # vLLM's BeamSearchOutput: each sequence's tokens start with the prompt's.
        assert all(s.tokens[: len(prompt)] == prompt for s in out.sequences)
        assert [s.tokens[len(prompt) :] for s in out.sequences] == [t for t, _ in expected]
        assert [s.cum_logprob for s in out.sequences] == pytest.approx(
            [c for _, c in expected], abs=1e-3
        )
        for s in out.sequences:
            assert len(s.logprobs) == len(s.tokens) - len(prompt)
            assert sum(lp.logprob for d in s.logprobs for lp in d.values()) == pytest.approx(
                s.cum_logprob, abs=1e-4
            )
    stops = [s.finish_reason for o in outs for s in o.sequences]
    assert ("stop" in stops) != ignore_eos  # an EOS-ended beam ranks among the best
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


# ---- swap preemption -----------------------------------------------------------------------
def _outputs(llm, prompts):
    sample = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=16, ignore_eos=True)
    greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    sampled = [
        [c.token_ids for c in o.outputs]
        for o in llm.generate(prompts[:5], sample, use_tqdm=False)
    ]
    beams = [
        [s.tokens for s in o.sequences]
        for o in llm.beam_search(prompts[:4], BeamSearchParams(3, 12), use_tqdm=False)
    ]
    return greedy, sampled, beams


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_swap_preemption_matches_unconstrained(llama, device):
    prompts = _prompts([2, 9, 17, 30], seed=2) + [list(range(i, i + 30)) for i in range(0, 360, 40)]
    common = dict(block_size=8, device=device, dtype="float32", max_model_len=96)
    ref = LLM(str(llama), kv_cache_memory=1 << 22, **common)
    expected = _outputs(ref, prompts)
    assert ref.scheduler.num_preemptions == 0
    per_block = ref.runner.kv_bytes_per_block
    del ref
    need = sum(-(-(len(p) + 24) // 8) for p in prompts)
    num_blocks = need // 4  # far too small for the batch
    for swap_blocks, all_swapped in ((256, True), (8, False)):
        llm = LLM(str(llama), kv_cache_memory=per_block * num_blocks, preemption_mode="swap",
                  swap_space=swap_blocks * per_block / 2**30, **common)  # fmt: skip
        assert llm.block_manager.num_blocks == num_blocks
        assert llm.block_manager.cpu_pool.num_blocks == swap_blocks
        assert _outputs(llm, prompts) == expected
        s = llm.scheduler
        assert s.num_swap_outs > 0
        # A small pool cannot take every group: those fall back to recompute.
        assert (s.num_swap_outs == s.num_preemptions) == all_swapped
        assert llm.block_manager.num_free_blocks == num_blocks
        assert llm.block_manager.cpu_pool.num_free_blocks == swap_blocks
        del llm


def test_logprobs_survive_recompute_preemption(llama):
    """A sequence preempted by recompute keeps the logprobs of the tokens it had: a pool far
    too small gives the logprobs (and their sums) of an unconstrained one."""
    prompts = _prompts([2, 9, 17, 30], seed=3) + [list(range(i, i + 30)) for i in range(0, 200, 40)]
    kinds = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=1.0, seed=4, max_tokens=24, ignore_eos=True, logprobs=1),
        SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=24, ignore_eos=True, logprobs=2),
    ]
    params = [kinds[i % 3] for i in range(len(prompts))]
    common = dict(block_size=8, dtype="float32", max_model_len=96)
    ref = LLM(str(llama), kv_cache_memory=1 << 22, **common)
    expected = ref.generate(prompts, params, use_tqdm=False)
    per_block = ref.runner.kv_bytes_per_block
    del ref
    need = sum(-(-(len(p) + 24) // 8) for p in prompts)
    llm = LLM(str(llama), kv_cache_memory=per_block * (need // 4), **common)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert llm.scheduler.num_preemptions > 0
    for e, g in zip(expected, got):
        assert len(g.outputs) == len(e.outputs)
        for ce, cg in zip(e.outputs, g.outputs):
            assert cg.token_ids == ce.token_ids
            assert len(cg.logprobs) == len(cg.token_ids) == 24
            for de, dg in zip(ce.logprobs, cg.logprobs):
                assert [(t, v.rank) for t, v in dg.items()] == [(t, v.rank) for t, v in de.items()]
                # fp32 logits of a recomputed prompt differ from the decoded ones in the
                # summation order: agreement to a few ulps, not bits.
                assert [v.logprob for v in dg.values()] == pytest.approx(
                    [v.logprob for v in de.values()], rel=2e-5, abs=1e-5
                )
            assert cg.cumulative_logprob == pytest.approx(ce.cumulative_logprob, abs=1e-4)
            chosen = [d[t].logprob for t, d in zip(cg.token_ids, cg.logprobs)]
            assert cg.cumulative_logprob == sum(chosen)  # the same additions, in order


def test_preemption_settings_are_checked(llama):
    with pytest.raises(ValueError, match="preemption_mode must be one of 'recompute', 'swap'"):
        LLM(str(llama), kv_cache_memory=1 << 22, preemption_mode="offload")
    with pytest.raises(ValueError, match="swap_space"):
        LLM(str(llama), kv_cache_memory=1 << 22, preemption_mode="swap", swap_space=-1)
    llm = LLM(str(llama), kv_cache_memory=1 << 20, block_size=8, max_model_len=64)
    with pytest.raises(ValueError, match="n=64 exceeds max_num_batched|KV blocks"):
        llm.generate([[1, 2, 3]], SamplingParams(n=64, max_tokens=60), use_tqdm=False)
    with pytest.raises(ValueError, match="beam_width=300 exceeds max_num_seqs"):
        llm.beam_search([[1, 2]], BeamSearchParams(beam_width=300, max_tokens=4))


# ---- logprobs and penalties ----------------------------------------------------------------
def test_logprobs_equal_hf_log_softmax(llama, hf_model):
    llm = LLM(str(llama), dtype="float32", kv_cache_memory=1 << 22)
    prompts = _prompts([3, 20], seed=5)
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=4),
        SamplingParams(temperature=1.0, seed=1, max_tokens=12, ignore_eos=True, logprobs=2),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, outs):
        c = out.outputs[0]
        lp = _hf_logprobs(hf_model, prompt + c.token_ids)[len(prompt) - 1 : -1]
        assert len(c.logprobs) == len(c.token_ids) == 12
        for t, (token, d) in enumerate(zip(c.token_ids, c.logprobs)):
            top = lp[t].topk(p.logprobs).indices.tolist()
            assert set(d) == set(top) | {token}
            for k, v in d.items():
                assert v.logprob == pytest.approx(lp[t, k].item(), abs=1e-4)
                assert v.rank == int((lp[t] > lp[t, k]).sum()) + 1  # 1-based, raw distribution
        total = sum(lp[t, tok].item() for t, tok in enumerate(c.token_ids))
        assert c.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_repetition_penalty_matches_hf_generate(llama, hf_model):
    prompts = _prompts([4, 25], seed=6)
    llm = LLM(str(llama), dtype="float32", kv_cache_memory=1 << 22)
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.8)
    outs = llm.generate(prompts, p, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=20, repetition_penalty=1.8,
                                    eos_token_id=None, pad_token_id=0)  # fmt: skip
        assert out.outputs[0].token_ids == gen[0, len(prompt) :].tolist()
    plain = llm.generate(prompts, replace(p, repetition_penalty=1.0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] != [o.outputs[0].token_ids for o in outs]


def test_presence_and_frequency_penalties_match_plain_loop(llama, hf_model):
    prompts = _prompts([6, 11], seed=7)
    llm = LLM(str(llama), dtype="float32", kv_cache_memory=1 << 22)
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, presence_penalty=1.5,
                       frequency_penalty=0.8)  # fmt: skip
    outs = llm.generate(prompts, p, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        tokens = list(prompt)
        for _ in range(16):
            with torch.no_grad():
                logits = hf_model(torch.tensor([tokens])).logits[0, -1].float()
            generated = tokens[len(prompt) :]
            for t in set(generated):
                logits[t] -= 0.8 * generated.count(t) + 1.5
            tokens.append(int(logits.argmax()))
        assert out.outputs[0].token_ids == tokens[len(prompt) :]
