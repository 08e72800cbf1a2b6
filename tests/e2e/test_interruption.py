"""An exception or a KeyboardInterrupt anywhere inside generate leaves no block held, no request
queued, and an LLM that answers exactly like a fresh one afterwards.

Faults are injected at each stage of a step (scheduling/allocation, the forward pass between
two layers, sampling, postprocessing, stop-string detokenization) after a few calls, so they
land mid-run with sequences waiting, running, chunk-prefilled, forked, preempted and swapped;
a timer thread also interrupts the main thread at arbitrary moments, like Ctrl-C in a notebook.
"""

from __future__ import annotations

import _thread
import gc
import signal
import threading
import time
import weakref

import pytest
from tiny_models import add_byte_tokenizer, make_tiny_model

from nanopaged import LLM, BeamSearchParams, Logprob, SamplingParams
from nanopaged.engine import llm_engine, model_runner
from nanopaged.sampling import sampler as sampler_module

# Tight enough that prefills are chunked and sequences get preempted.
ENGINE = dict(kv_cache_memory=24 * 8192, max_model_len=128, max_num_batched_tokens=48)
PROMPTS = [[(7 * i + j) % 500 + 1 for j in range(18 + 5 * i)] for i in range(6)] + [
    "the quick brown fox",
    "the quick brown fox jumps",  # shares a prefix with the previous one
]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True),
    SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=40, seed=3, max_tokens=20, logprobs=2),
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, min_tokens=4),
    SamplingParams(temperature=0, max_tokens=24, stop=["zz", "q"], ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.5, seed=9, max_tokens=12, repetition_penalty=1.2),
]


class Injected(Exception):
    pass


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    add_byte_tokenizer(path)
    return path


class Logprobs:
    """Logprobs that compare equal up to fp32 rounding: a prompt read from the prefix cache
    was computed in other chunks than a recomputed one, so its logits differ in the last bits."""

    def __init__(self, steps: list[dict[int, Logprob]] | None) -> None:
        self.steps = steps

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Logprobs) or (self.steps is None) != (other.steps is None):
            return False
        return self.steps is None or (
            [list(d) for d in self.steps] == [list(d) for d in other.steps]
            and all(
                v.logprob == pytest.approx(other_d[t].logprob, rel=1e-4, abs=1e-5)
                for d, other_d in zip(self.steps, other.steps)
                for t, v in d.items()
            )
        )

    def __repr__(self) -> str:
        return f"Logprobs({self.steps})"


def _results(llm: LLM):
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [
        [(c.token_ids, c.text, c.finish_reason, Logprobs(c.logprobs)) for c in o.outputs]
        for o in outs
    ]


def _llm(model_dir, **engine) -> LLM:
    """An LLM whose KV cache starts as NaN: reading a slot no step wrote poisons the output."""
    llm = LLM(str(model_dir), **ENGINE, **engine)
    llm.runner.kv_cache.fill_(float("nan"))
    return llm


@pytest.fixture(scope="module")
def expected(model_dir):
    fresh = LLM(str(model_dir), **ENGINE)
    fresh.runner.kv_cache.zero_()
    first = _results(fresh)
    assert fresh.scheduler.num_preemptions > 0  # the workload really preempts
    return first


def test_unwritten_kv_slots_are_never_read(model_dir, expected):
    # torch.empty memory may hold NaN; a slot past a sequence's context must not leak into it.
    assert _results(_llm(model_dir)) == expected


def _assert_clean(llm: LLM) -> None:
    assert not llm.scheduler.has_unfinished()
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not any(bm.ref_counts) and bm.num_shared_blocks == 0
    assert bm.cpu_pool.num_free_blocks == bm.cpu_pool.num_blocks
    assert not any(bm.cpu_pool.ref_counts)
    for h, b in bm.hash_to_block.items():  # what stays cached is still consistent
        assert bm.block_hashes[b] == h
    assert gc.isenabled()  # automatic collection, off while the run lasted, is back


def _fail_on_call(k: int, exc: type[BaseException], fn, after: bool = False):
    """fn, except that its k-th call raises exc (before running, or after when `after`)."""
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == k and not after:
            raise exc("injected")
        out = fn(*args, **kwargs)
        if calls[0] == k and after:
            raise exc("injected")
        return out

    wrapper.calls = calls
    return wrapper


def _inject(llm: LLM, monkeypatch, where: str, k: int, exc: type[BaseException]):
    """Arrange for exc to be raised at the k-th call of the stage `where`; returns the counter."""
    if where == "sampler":  # both the plain sampler and the one for forks/logprobs/penalties
        calls = [0]
        for name in ("sample", "sample_sequences"):
            real = getattr(sampler_module, name)

            def wrapper(*args, _real=real, **kwargs):
                calls[0] += 1
                if calls[0] == k:
                    raise exc("injected")
                return _real(*args, **kwargs)

            monkeypatch.setattr(sampler_module, name, wrapper)
        return calls
    if where == "forward":  # between the two decoder layers: layer 0 has written its KV
        layer = llm.runner.model.model.layers[1]
        wrapper = _fail_on_call(k, exc, layer.forward)
        monkeypatch.setattr(layer, "forward", wrapper)
    elif where == "allocate":  # a group got its blocks but is not running yet
        wrapper = _fail_on_call(k, exc, llm.block_manager.allocate_group, after=True)
        monkeypatch.setattr(llm.block_manager, "allocate_group", wrapper)
    elif where == "take_block":  # inside allocate/append_slots, half done
        wrapper = _fail_on_call(k, exc, llm.block_manager._take_free_block)
        monkeypatch.setattr(llm.block_manager, "_take_free_block", wrapper)
    elif where == "commit":  # tokens appended, blocks cached, some sequences finished
        # Every step's samples are applied by commit, whether or not the next step ran ahead.
        calls = [0]
        real = llm.scheduler.commit

        def applied(*args, **kwargs):
            calls[0] += 1
            out = real(*args, **kwargs)
            if calls[0] == k:
                raise exc("injected")
            return out

        monkeypatch.setattr(llm.scheduler, "commit", applied)
        return calls
    elif where == "stop_strings":
        wrapper = _fail_on_call(k, exc, llm.tokenizer.decode)
        monkeypatch.setattr(llm.tokenizer, "decode", wrapper)
    else:
        raise AssertionError(where)
    return wrapper.calls


@pytest.mark.parametrize("exc", [Injected, KeyboardInterrupt])
@pytest.mark.parametrize(
    "where, k",
    [
        ("sampler", 1),
        ("sampler", 6),
        ("sampler", 15),
        ("forward", 3),
        ("forward", 12),
        ("allocate", 2),
        ("allocate", 9),
        ("take_block", 4),  # these three land inside allocate, with part of a table taken
        ("take_block", 13),
        ("take_block", 27),
        ("commit", 4),
        ("commit", 11),
        ("stop_strings", 3),
    ],
)
def test_fault_inside_a_step(model_dir, expected, monkeypatch, where, k, exc):
    llm = _llm(model_dir)
    with monkeypatch.context() as m:
        calls = _inject(llm, m, where, k, exc)
        with pytest.raises(exc, match="injected"):
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert calls[0] == k
    _assert_clean(llm)
    assert _results(llm) == expected
    _assert_clean(llm)


@pytest.mark.parametrize(
    "engine",
    [dict(preemption_mode="swap", swap_space=0.01), dict(async_scheduling=True)],
    ids=["swap", "async"],
)
@pytest.mark.parametrize("where, k", [("sampler", 7), ("forward", 10), ("commit", 6)])
def test_fault_with_swap_or_async_scheduling(model_dir, expected, monkeypatch, engine, where, k):
    llm = _llm(model_dir, **engine)
    assert _results(llm) == expected
    with monkeypatch.context() as m:
        _inject(llm, m, where, k, KeyboardInterrupt)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    _assert_clean(llm)
    assert _results(llm) == expected


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt during the test, as in an interactive session. A
    background job of a non-interactive shell (`pytest ... &`) starts with SIGINT ignored, and
    then interrupt_main, like the signal itself, does nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_at_arbitrary_moments(model_dir, expected, ctrl_c_raises):
    """A real asynchronous KeyboardInterrupt, as Ctrl-C delivers it, at spread-out times."""
    llm = _llm(model_dir)
    t0 = time.perf_counter()
    assert _results(llm) == expected
    duration = time.perf_counter() - t0
    interrupted = 0
    for fraction in (0.01, 0.1, 0.2, 0.3, 0.45, 0.6, 0.75, 0.9):
        timer = threading.Timer(duration * fraction, _thread.interrupt_main)
        timer.start()
        try:
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
            timer.join()  # finished first: the interrupt lands here instead
            for _ in range(10_000):
                pass
        except KeyboardInterrupt:
            interrupted += 1
        finally:
            timer.cancel()
            timer.join()
        _assert_clean(llm)
    assert interrupted >= 4
    assert _results(llm) == expected


def test_collector_paused_while_generating(model_dir, monkeypatch):
    # During a run automatic collection is off (young generations collected every
    # GC_YOUNG_EVERY steps, never a full pass) and back afterwards. A program that turned
    # collection off itself finds it off.
    llm = _llm(model_dir)
    monkeypatch.setattr(llm_engine, "GC_YOUNG_EVERY", 2)
    seen, generations = [], []
    submit = model_runner.ModelRunner.submit

    def watched(self, *args, **kwargs):
        seen.append(gc.isenabled())
        return submit(self, *args, **kwargs)

    def note(phase, info):
        if phase == "start":
            generations.append(info["generation"])

    monkeypatch.setattr(model_runner.ModelRunner, "submit", watched)
    gc.callbacks.append(note)
    try:
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert seen and not any(seen) and gc.isenabled()
        assert generations and max(generations) == 1  # young collections only
        gc.disable()
        seen.clear()
        generations.clear()
        llm.generate(PROMPTS[:2], PARAMS[:2], use_tqdm=False)
        assert seen and not gc.isenabled() and not generations
    finally:
        gc.callbacks.remove(note)
        gc.enable()


@pytest.mark.parametrize(
    "engine",
    [{}, dict(preemption_mode="swap", swap_space=0.01), dict(async_scheduling=True),
     dict(kv_cache_dtype="fp8")],
    ids=["recompute", "swap", "async", "fp8"],
)  # fmt: skip
def test_dropped_llm_freed_without_the_collector(model_dir, engine):
    # Nothing of a dropped LLM may wait for a collection (a full one walks the whole heap):
    # reference counting alone frees it, after generate and beam search.
    llm = _llm(model_dir, **engine)
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    llm.beam_search([{"prompt_token_ids": [5, 6, 7]}], BeamSearchParams(beam_width=2, max_tokens=4))
    refs = [weakref.ref(o) for o in (llm, llm.runner, llm.runner.model, llm.runner.kv_cache,
                                     llm.engine, llm.scheduler, llm.block_manager)]  # fmt: skip
    gc.disable()
    try:
        del llm
        assert all(r() is None for r in refs), [r() is None for r in refs]
    finally:
        gc.enable()
