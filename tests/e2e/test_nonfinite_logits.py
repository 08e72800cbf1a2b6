"""Logits that turn NaN at run time end the run with NonFiniteLogitsError naming the requests,
on every sampling path, instead of a token sampled from them; the LLM stays usable.

The model overflows for real: a tiny Llama whose layer-0 MLP has finite but large gate/up
weights on hidden dimension 0, which only one token's embedding (the poisoned token) feeds.
Its activations pass float16's largest value (inf, then inf - inf = NaN in down_proj), and the
NaN reaches every later position of the request through attention; in float32 they stay
finite. Every other token leaves dimension 0 exactly zero, so other requests are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny_model

from nanopaged import LLM, BeamSearchParams, SamplingParams
from nanopaged.engine import model_runner
from nanopaged.sampling import output
from nanopaged.sampling.output import NonFiniteLogitsError

ENGINE = dict(dtype="float16", device="cpu", kv_cache_memory=1 << 22)
# layer 0's gate/up weights on dimension 0: their product reaches ~(8 * 300)^2, past 65504.
POISON_WEIGHT = 300.0
HEALTHY = [[(11 * i + j) % 480 + 20 for j in range(20 + 3 * i)] for i in range(3)]
DECODE_PROMPT = [40, 41, 42, 43, 44]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
ALLOWED = [3, 4, 5, 6]
PARAMS = {
    "greedy": GREEDY,
    "seeded": SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True),
    "filters": SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=4,
                              max_tokens=6, ignore_eos=True),  # fmt: skip
    "allowed_token_ids": SamplingParams(temperature=1.0, seed=5, allowed_token_ids=ALLOWED,
                                        max_tokens=6, ignore_eos=True),  # fmt: skip
    "logprobs": SamplingParams(temperature=0.7, seed=6, logprobs=2, max_tokens=6,
                               ignore_eos=True),  # fmt: skip
    # logprobs while min_tokens masks EOS: sample_sequences
    "logprobs_min_tokens": SamplingParams(temperature=0.7, seed=7, logprobs=2, min_tokens=3,
                                          max_tokens=6),  # fmt: skip
    "penalties": SamplingParams(temperature=0.8, seed=8, repetition_penalty=1.3,
                                presence_penalty=0.5, max_tokens=6, ignore_eos=True),
    # penalties with logprobs: sample_sequences
    "penalties_logprobs": SamplingParams(temperature=0, frequency_penalty=0.4, logprobs=1,
                                         max_tokens=6, ignore_eos=True),  # fmt: skip
    "n2": SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=6, ignore_eos=True),
}


@dataclass
class Poisoned:
    path: Path
    token: int  # the poisoned token
    # DECODE_PROMPT's greedy continuation (on the device the model was built for): its last
    # token is the poisoned one, sampled from finite logits; the next step's logits are NaN.
    continuation: list[int]

    def prompts(self) -> list[list[int]]:
        """Healthy prompts and, at rows 1 and 3, two holding the poisoned token."""
        t = self.token
        return [HEALTHY[0], [50, t, 51, 52], HEALTHY[1], [t], HEALTHY[2]]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def _save(path: Path, weights: dict[str, torch.Tensor]) -> None:
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def make_poisoned(path: Path, device: str) -> Poisoned:
    """A tiny Llama as the module docstring says; the poisoned token is the first token of
    DECODE_PROMPT's greedy continuation (from its third on) that no healthy run of the tests
    reads or writes."""
    make_tiny_model(path, "llama")
    w = _weights(path)
    w["model.embed_tokens.weight"][:, 0] = 0
    w["model.layers.0.self_attn.o_proj.weight"][0] = 0  # attention writes nothing there
    w["model.layers.0.mlp.gate_proj.weight"][:, 0] = POISON_WEIGHT
    w["model.layers.0.mlp.up_proj.weight"][:, 0] = POISON_WEIGHT
    _save(path, w)
    # Until a token's embedding holds dimension 0, the weights above multiply zeros.
    llm = LLM(str(path), **{**ENGINE, "device": device})
    seen = set(ALLOWED) | {t for p in HEALTHY + [DECODE_PROMPT] for t in p}
    # The healthy prompts' greedy runs of the decode tests are longer than PARAMS'.
    longer = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for params in [*PARAMS.values(), longer]:
        for out in llm.generate(HEALTHY, params, use_tqdm=False):
            seen.update(t for c in out.outputs for t in c.token_ids)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cont = llm.generate([DECODE_PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids
    k = next(i for i in range(2, len(cont)) if cont[i] not in seen and cont[i] not in cont[:i])
    token = cont[k]
    w["model.embed_tokens.weight"][token] = 0
    w["model.embed_tokens.weight"][token, 0] = 100.0
    _save(path, w)
    return Poisoned(path, token, cont[: k + 1])


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory) -> Poisoned:
    return make_poisoned(tmp_path_factory.mktemp("poisoned"), "cpu")


def _record_requests(llm: LLM, monkeypatch) -> dict[tuple[int, ...], str]:
    """prompt tokens -> request id of every request the scheduler takes from now on."""
    ids: dict[tuple[int, ...], str] = {}
    real = llm.scheduler.add

    def add(group):
        group = real(group)
        seq = group.seqs[0]
        ids[tuple(seq.token_ids[: seq.num_prompt_tokens])] = group.request_id
        return group

    monkeypatch.setattr(llm.scheduler, "add", add)
    return ids


def _assert_idle(llm: LLM) -> None:
    """No request left, no block held."""
    assert not llm.scheduler.has_unfinished()
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not any(bm.ref_counts)


def _healthy(llm: LLM, params: SamplingParams) -> list:
    outs = llm.generate(HEALTHY, params, use_tqdm=False)
    return [
        [(c.token_ids, None if c.logprobs is None else [sorted(d) for d in c.logprobs])
         for c in o.outputs]
        for o in outs
    ]  # fmt: skip


def _fresh(poisoned: Poisoned, **engine) -> LLM:
    return LLM(str(poisoned.path), **{**ENGINE, **engine})


@pytest.mark.parametrize("name", list(PARAMS))
def test_nan_rows_raise_naming_their_requests(poisoned, monkeypatch, name):
    params = PARAMS[name]
    llm = _fresh(poisoned)
    ids = _record_requests(llm, monkeypatch)
    prompts = poisoned.prompts()
    with pytest.raises(NonFiniteLogitsError) as err:
        llm.generate(prompts, params, use_tqdm=False)
    assert sorted(err.value.request_ids) == sorted(ids[tuple(prompts[i])] for i in (1, 3))
    assert 'dtype="float32"' in str(err.value)
    assert str(err.value).startswith("the logits of prompts[") and all(
        f"prompts[{i}]" in str(err.value) for i in (1, 3))
    # Their K/V, NaN now, is zeroed and out of the prefix cache: a kernel weighing a stale
    # slot of a reused block by 0 must not get NaN.
    assert bool(torch.isfinite(llm.runner.kv_cache).all())
    _assert_idle(llm)
    assert _healthy(llm, params) == _healthy(_fresh(poisoned), params)


def test_float32_computes_what_float16_overflows(poisoned):
    # The weights are finite: in float32 the same requests run, as the error suggests.
    outs = _fresh(poisoned, dtype="float32").generate(poisoned.prompts(), GREEDY,
                                                      use_tqdm=False)  # fmt: skip
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "run_ahead"])
def test_logits_turning_nan_mid_decode(poisoned, monkeypatch, async_scheduling):
    """The request samples the poisoned token from finite logits, and the next step's logits
    are NaN; with asynchronous scheduling a step was launched on top of that one."""
    llm = _fresh(poisoned, async_scheduling=async_scheduling)
    cont = poisoned.continuation
    upto = SamplingParams(temperature=0, max_tokens=len(cont), ignore_eos=True)
    outs = llm.generate(HEALTHY + [DECODE_PROMPT], upto, use_tqdm=False)
    assert outs[-1].outputs[0].token_ids == cont  # up to the poisoned token: fine

    ids = _record_requests(llm, monkeypatch)
    launched, read = _record_steps(llm, monkeypatch)
    past = SamplingParams(temperature=0, max_tokens=len(cont) + 4, ignore_eos=True)
    with pytest.raises(NonFiniteLogitsError) as err:
        llm.generate(HEALTHY + [DECODE_PROMPT], past, use_tqdm=False)
    assert err.value.request_ids == [ids[tuple(DECODE_PROMPT)]]
    # The run stopped at the first step with NaN logits; with asynchronous scheduling the
    # step launched on top of it (NaN too: it read that step's KV) was dropped unread.
    failed = [h for h, exc in read if exc is not None]
    assert failed == [read[-1][0]] and read[-1][1].request_ids == err.value.request_ids
    if async_scheduling:
        assert launched[-1][1] is failed[0]
        assert launched[-1][0] not in [h for h, _ in read]
    else:
        assert launched[-1][0] is failed[0]
    _assert_idle(llm)
    monkeypatch.undo()
    assert _healthy(llm, GREEDY) == _healthy(_fresh(poisoned), GREEDY)


def _record_steps(llm: LLM, monkeypatch) -> tuple[list, list]:
    """From now on: every launched step's (handle, the step it was launched on top of), and
    every read of a step's samples (handle, the exception it raised or None)."""
    launched, read = [], []
    real_submit = llm.runner.submit
    real_result = output.StepHandle.result

    def submit(prepared, eos, prev=None):
        handle = real_submit(prepared, eos, prev)
        launched.append((handle, prev))
        return handle

    def result(handle):
        try:
            out = real_result(handle)
        except NonFiniteLogitsError as exc:
            read.append((handle, exc))
            raise
        read.append((handle, None))
        return out

    monkeypatch.setattr(llm.runner, "submit", submit)
    monkeypatch.setattr(output.StepHandle, "result", result)
    return launched, read


@pytest.mark.parametrize("n", [1, 2])
def test_allowed_token_ids_never_leave_the_allowed_set(poisoned, n):
    """Forced onto the poisoned token, the next step's NaN logits would draw token 0, which
    the request does not allow: the run stops instead."""
    llm = _fresh(poisoned)
    params = SamplingParams(n=n, temperature=1.0, seed=2, allowed_token_ids=[poisoned.token],
                            max_tokens=4, ignore_eos=True)  # fmt: skip
    with pytest.raises(NonFiniteLogitsError):
        llm.generate([DECODE_PROMPT], params, use_tqdm=False)
    _assert_idle(llm)
    assert _healthy(llm, GREEDY) == _healthy(_fresh(poisoned), GREEDY)


def test_beam_search(poisoned):
    llm = _fresh(poisoned)
    with pytest.raises(NonFiniteLogitsError):
        llm.beam_search([HEALTHY[0], poisoned.prompts()[1]],
                        BeamSearchParams(beam_width=2, max_tokens=3))  # fmt: skip
    _assert_idle(llm)
    assert _healthy(llm, GREEDY) == _healthy(_fresh(poisoned), GREEDY)


def test_tensor_parallel_sharded_and_gathered_sampling(poisoned, monkeypatch):
    """Rows by temperature alone (or greedy) sample over the ranks' vocabulary shards; top-p
    rows gather the logits. Both raise, and the workers stay in step for the next run."""
    sharded = PARAMS["seeded"]
    calls = []
    real = model_runner.sample_shards
    monkeypatch.setattr(model_runner, "sample_shards",
                        lambda *a: calls.append(1) or real(*a))  # fmt: skip
    with LLM(str(poisoned.path), tensor_parallel_size=2, **ENGINE) as llm:
        for params, shards in ((GREEDY, True), (sharded, True), (PARAMS["filters"], False)):
            before = len(calls)
            with pytest.raises(NonFiniteLogitsError):
                llm.generate(poisoned.prompts(), params, use_tqdm=False)
            assert (len(calls) > before) == shards
            _assert_idle(llm)
        got = _healthy(llm, sharded)
    assert got == _healthy(_fresh(poisoned), sharded)


# ---- CUDA: the decode graphs' samplers and the Triton kernels ----------------------------


@pytest.fixture(scope="module")
def poisoned_cuda(tmp_path_factory) -> Poisoned:
    return make_poisoned(tmp_path_factory.mktemp("poisoned-cuda"), "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["greedy", "seeded", "filters", "logprobs", "n2"])
def test_cuda_decode_graphs_raise(poisoned_cuda, monkeypatch, name):
    """Decode steps sampled inside the CUDA graphs (plain rows), and the eager paths."""
    llm = _fresh(poisoned_cuda, device="cuda")
    ids = _record_requests(llm, monkeypatch)
    cont = poisoned_cuda.continuation
    params = SamplingParams(temperature=0, max_tokens=len(cont) + 4, ignore_eos=True)
    with pytest.raises(NonFiniteLogitsError) as err:
        llm.generate(HEALTHY + [DECODE_PROMPT], params, use_tqdm=False)
    assert err.value.request_ids == [ids[tuple(DECODE_PROMPT)]]
    assert sum(llm.runner.graphs.sampled_steps.values()) > 0
    _assert_idle(llm)
    prompts = poisoned_cuda.prompts()
    with pytest.raises(NonFiniteLogitsError) as err:
        llm.generate(prompts, PARAMS[name], use_tqdm=False)
    assert sorted(err.value.request_ids) == sorted(ids[tuple(prompts[i])] for i in (1, 3))
    _assert_idle(llm)
    want = _healthy(_fresh(poisoned_cuda, device="cuda"), PARAMS[name])
    assert _healthy(llm, PARAMS[name]) == want


@pytest.mark.gpu
def test_cuda_sampler_paths_keep_nan_rows_in_the_vocabulary():
    """A step launched on top of a NaN step embeds its tokens before the error is seen: every
    sampler path must give NaN rows an id inside the vocabulary (and a NaN or -inf score)."""
    from nanopaged.sampling.ops import SAMPLER_PATHS, SamplingTensors, sample, with_path

    rows, vocab = 6, 5000
    dev = torch.device("cuda")
    logits = torch.randn(rows, vocab, device=dev, dtype=torch.float16)
    logits[1] = float("nan")
    logits[3, 7] = float("inf")
    logits[4, 9] = float("nan")
    st = SamplingTensors(
        temperatures=torch.tensor([0.0, 0.7, 1.0, 0.0, 0.9, 1.2], device=dev),
        top_ks=torch.tensor([0, 0, 40, 0, 0, 5], dtype=torch.int32, device=dev),
        top_ps=torch.tensor([1.0, 0.9, 1.0, 1.0, 0.8, 1.0], device=dev),
        min_ps=torch.tensor([0.0, 0.0, 0.05, 0.0, 0.0, 0.0], device=dev),
        seeds=torch.arange(rows, device=dev),
        offsets=torch.zeros(rows, dtype=torch.int64, device=dev),
    )
    for path in SAMPLER_PATHS:
        for logprobs in (0, 2):
            tokens = sample(logits, with_path(st, path), num_logprobs=logprobs).token_ids
            assert ((tokens >= 0) & (tokens < vocab)).all(), (path, tokens)
            picked = logits.gather(1, tokens[:, None])[:, 0]
            assert not picked[1].isfinite() and not picked[3].isfinite(), (path, picked)
            assert picked[[0, 2, 5]].isfinite().all(), (path, picked)
