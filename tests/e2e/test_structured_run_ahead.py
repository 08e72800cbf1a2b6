"""Constrained steps run ahead: a step's forward pass is launched before the previous step's
tokens reach the host, and only its sampler waits for the grammar masks those tokens decide.

The outputs equal a synchronous run's token for token (seeded sampling, every row constrained,
n=2, stop strings, min_tokens, logprobs, preemption, aborts while a step is in flight). Every
LLM here runs on the CPU, whose steps compute bit for bit alike whatever the batch (see
test_async_scheduling.py); the tiny model's byte-level tokenizer keeps grammars small."""

from __future__ import annotations

import importlib.util
import json
import random

import pytest

from nanopaged import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llguidance") is None
    or importlib.util.find_spec("jsonschema") is None,
    reason="pip install 'nanopaged[structured]' jsonschema",
)


@pytest.fixture(scope="module")
def byte_llama(tmp_path_factory):
    """A tiny random Llama with a byte-level tokenizer whose <eos> (id 256) is the model's
    EOS: the grammars end there, and no EOS decodes to a byte of the output."""
    from tiny_models import add_byte_tokenizer, make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("eos-llama"), "llama", eos_token_id=256)
    add_byte_tokenizer(path)
    return path


def _schema(i: int) -> dict:
    """Row i's own schema: bounded fields (a random model finishes it), names of its own."""
    properties = {
        f"s{i}": {"type": "string", "minLength": 1, "maxLength": 2 + i % 3},
        f"n{i}": {"type": "integer", "minimum": 0, "maximum": 10 * (i + 1)},
        f"e{i}": {"enum": [f"x{i}", "z"]},
        f"b{i}": {"type": "array", "items": {"type": "boolean"}, "maxItems": 1 + i % 2},
    }
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}  # fmt: skip


def _spec(i: int) -> StructuredOutputsParams:
    kind = i % 4
    if kind == 3:
        return StructuredOutputsParams(regex=r"[a-f]{2,5}-[0-9]{1,3}")
    if kind == 2:
        return StructuredOutputsParams(choice=["alpha", "beta", f"gamma{i}"])
    return StructuredOutputsParams(json=_schema(i))


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def _llm(path, async_scheduling: bool, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 1 << 22)
    return LLM(str(path), async_scheduling=async_scheduling, device="cpu", seed=0, **kw)


def _outputs(outs) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason,
              c.logprobs and [{t: (round(v.logprob, 4), v.rank) for t, v in d.items()}
                              for d in c.logprobs])
             for c in o.outputs] for o in outs]  # fmt: skip


def _spy_run_ahead(llm: LLM) -> list[tuple[bool, bool]]:
    """Record, per step, (every sampled row constrained, the step ran ahead)."""
    engine = llm.llm_engine
    seen: list[tuple[bool, bool]] = []
    decide = engine.may_run_ahead

    def spy(batch, handle):
        ahead = decide(batch, handle)
        sampled = [s for i, s in enumerate(batch.seqs) if batch.sampling[i]]
        seen.append((bool(sampled) and all(s.matcher is not None for s in sampled), ahead))
        return ahead

    engine.may_run_ahead = spy
    return seen


def test_every_row_constrained_runs_ahead_and_equals_sync(byte_llama):
    import jsonschema

    prompts = _prompts(8, seed=0)
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=96, n=2 if i % 3 == 0 else 1,
                             structured_outputs=_spec(i)) for i in range(len(prompts))]  # fmt: skip
    # Four sequences at a time: requests join, prefill and fork while others run ahead.
    sync_llm = _llm(byte_llama, False, max_num_seqs=4)
    sync = _outputs(sync_llm.generate(prompts, params, use_tqdm=False))
    llm = _llm(byte_llama, True, max_num_seqs=4)
    seen = _spy_run_ahead(llm)
    ahead = _outputs(llm.generate(prompts, params, use_tqdm=False))
    assert ahead == sync
    assert sync_llm.scheduler.num_advanced_steps == 0
    # Steps whose every row has a grammar ran ahead (all but the prefills, forks and the
    # steps a joining request makes structural).
    constrained_ahead = sum(c and a for c, a in seen)
    assert constrained_ahead >= 0.6 * sum(c for c, _ in seen), seen
    assert llm.scheduler.num_advanced_steps >= constrained_ahead
    # The constraints held: every output that stopped matches its spec.
    stopped = 0
    for i, out in enumerate(ahead):
        spec = params[i].structured_outputs
        for _, text, reason, _, _ in out:
            if reason != "stop":
                continue
            stopped += 1
            if spec.json is not None:
                jsonschema.validate(json.loads(text), spec.json)
            elif spec.choice is not None:
                assert text in spec.choice
    assert stopped >= 0.9 * sum(len(o) for o in ahead)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_stop_strings_min_tokens_logprobs_and_penalties_with_masks_run_ahead(byte_llama):
    prompts = _prompts(15, seed=1)
    params = [
        SamplingParams(temperature=0.8, seed=1, max_tokens=40, stop=["e"],
                       structured_outputs=_spec(0)),
        SamplingParams(temperature=0.8, seed=2, max_tokens=40, min_tokens=10,
                       structured_outputs=_spec(2)),  # the finished grammar lifts min_tokens
        SamplingParams(temperature=0.8, seed=3, max_tokens=40, logprobs=3,
                       structured_outputs=_spec(1)),
        SamplingParams(temperature=0, max_tokens=40, logprobs=0, structured_outputs=_spec(3)),
        SamplingParams(temperature=0.8, seed=5, max_tokens=90, ignore_eos=True,
                       structured_outputs=_spec(5)),  # ends with its grammar ("stop")
        SamplingParams(temperature=0.8, seed=6, max_tokens=20),  # no grammar beside them
        # Penalties are counted when the step launches, the mask applied when it samples.
        SamplingParams(temperature=0.8, seed=7, max_tokens=40, presence_penalty=1.5,
                       frequency_penalty=0.5, min_tokens=3, structured_outputs=_spec(6)),
    ] + [  # min_tokens where the grammar allows EOS from the first letter on
        SamplingParams(temperature=1.5, seed=10 + i, max_tokens=30, min_tokens=4,
                       structured_outputs=StructuredOutputsParams(regex="[a-f]{1,12}"))
        for i in range(8)
    ]  # fmt: skip
    sync = _outputs(_llm(byte_llama, False).generate(prompts, params, use_tqdm=False))
    llm = _llm(byte_llama, True)
    seen = _spy_run_ahead(llm)
    ahead = _outputs(llm.generate(prompts, params, use_tqdm=False))
    assert [[c[:4] for c in o] for o in ahead] == [[c[:4] for c in o] for o in sync]
    assert [[c[4] for c in o] for o in ahead] == [[c[4] for c in o] for o in sync]
    assert sum(c and a for c, a in seen) >= 5, seen
    assert ahead[1][0][2] == "stop" and ahead[1][0][1] in params[1].structured_outputs.choice
    assert ahead[4][0][2] == "stop"
    lengths = [len(o[0][0]) for o in ahead[7:]]
    # Four letters, then EOS at the first step allowed (in token_ids): the boundary is hit,
    # so a min_tokens count off by one there would differ from the synchronous run.
    assert min(lengths) == 5, lengths


def test_preemption_and_swap_with_every_row_constrained(byte_llama):
    prompts = _prompts(6, seed=2)
    params = [SamplingParams(temperature=0.9, seed=10 + i, max_tokens=40, ignore_eos=True,
                             n=2 if i % 2 else 1, structured_outputs=_spec(i))
              for i in range(len(prompts))]  # fmt: skip
    expected = _outputs(_llm(byte_llama, False).generate(prompts, params, use_tqdm=False))
    per_block = _llm(byte_llama, False).runner.kv_bytes_per_block
    for mode in ("recompute", "swap"):
        tight = _llm(byte_llama, True, kv_cache_memory=10 * per_block, max_model_len=128,
                     preemption_mode=mode)  # fmt: skip
        outs = _outputs(tight.generate(prompts, params, use_tqdm=False))
        assert tight.scheduler.num_preemptions > 0, mode
        assert tight.scheduler.num_advanced_steps > 0, mode
        assert outs == expected, mode


def test_abort_while_a_constrained_step_is_in_flight(byte_llama):
    prompts = _prompts(4, seed=3)
    params = [SamplingParams(temperature=0.9, seed=20 + i, max_tokens=30, ignore_eos=True,
                             structured_outputs=_spec(i)) for i in range(len(prompts))]  # fmt: skip
    alone = _outputs(_llm(byte_llama, True).generate(prompts[1:], params[1:], use_tqdm=False))
    llm = _llm(byte_llama, True)
    engine = llm.llm_engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    done = {}
    for step in range(200):
        if step == 4:
            assert engine._in_flight is not None  # a constrained step launched ahead
            engine.abort_request("0")
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert "0" not in done and sorted(done) == ["1", "2", "3"]
    assert _outputs([done[str(i)] for i in (1, 2, 3)]) == alone
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_an_error_on_the_matchers_thread_surfaces_and_the_llm_stays_usable(byte_llama):
    # The matchers advance on the grammar backend's thread while the engine plans the next
    # step: an error there is raised by the step that waits for them, every request is
    # dropped, and the next generate runs as on a fresh LLM.
    prompts = _prompts(3, seed=5)
    params = [SamplingParams(temperature=0.9, seed=30 + i, max_tokens=24,
                             structured_outputs=_spec(i)) for i in range(len(prompts))]  # fmt: skip
    expected = _outputs(_llm(byte_llama, True).generate(prompts, params, use_tqdm=False))
    llm = _llm(byte_llama, True)
    llm.generate(prompts[:1], params[:1], use_tqdm=False)  # the backend exists from here on
    filler = llm.runner.sampler.structured.filler
    accept_one, calls = filler.accept_one, []

    def broken(rows):
        calls.append(len(rows))
        if len(calls) == 3:
            raise RuntimeError("the matchers broke")
        return accept_one(rows)

    filler.accept_one = broken
    with pytest.raises(RuntimeError, match="the matchers broke"):
        llm.generate(prompts, params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert _outputs(llm.generate(prompts, params, use_tqdm=False)) == expected


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_cuda_constrained_steps_run_ahead_and_equal_sync(byte_llama, enforce_eager):
    # On CUDA (graphs: the forward replays, the masked sampler runs after it): greedy rows
    # equal the synchronous run's (fp32, the tiny model's logits far apart), seeded rows
    # follow their grammars, and the constrained steps ran ahead.
    prompts = _prompts(12, seed=4)
    params = [SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, max_tokens=96,
                             n=2 if i % 3 == 0 else 1, structured_outputs=_spec(i))
              for i in range(len(prompts))]  # fmt: skip
    runs = {}
    for async_scheduling in (False, True):
        llm = LLM(str(byte_llama), dtype="float32", device="cuda", kv_cache_memory=1 << 26,
                  enforce_eager=enforce_eager, async_scheduling=async_scheduling)  # fmt: skip
        seen = _spy_run_ahead(llm)
        runs[async_scheduling] = _outputs(llm.generate(prompts, params, use_tqdm=False))
        assert (sum(c and a for c, a in seen) > 0.5 * len(seen)) == async_scheduling, seen
        assert llm.runner.sampler.structured.stats.mask_steps > 0
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    assert [runs[True][i] for i in greedy] == [runs[False][i] for i in greedy]
    for out in runs[True]:
        assert all(reason in ("stop", "length") for _, _, reason, _, _ in out)
    assert sum(c[2] == "stop" for o in runs[True] for c in o) >= 0.9 * sum(map(len, runs[True]))


def test_one_schema_over_lanes_equals_one_lexer(byte_llama):
    # One schema for every row: with three fill threads its rows spread over three lanes
    # (lexers of their own) and their masks fill ahead of each step, on the prefetch thread;
    # the tokens equal a synchronous run's on one lane, every mask filled in place.
    from nanopaged.structured import StructuredBackend

    spec = StructuredOutputsParams(json=_schema(1))
    prompts = _prompts(6, seed=3)
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=64, n=2 if i == 0 else 1,
                             structured_outputs=spec) for i in range(len(prompts))]  # fmt: skip
    runs = []
    for async_scheduling, threads in ((False, 1), (True, 3)):
        llm = _llm(byte_llama, async_scheduling, max_num_seqs=4)
        engine = llm.llm_engine
        backend = StructuredBackend(engine.tokenizer, engine.model_config.vocab_size,
                                    engine.eos_token_ids, fill_threads=threads)  # fmt: skip
        llm.runner.sampler.structured = backend
        runs.append(_outputs(llm.generate(prompts, params, use_tqdm=False)))
        stats = backend.stats
        assert backend.compiler.num_lanes == threads and stats.mask_steps > 0
        assert stats.prefetch_seconds > 0  # steps after the first took masks filled ahead
        backend.close()
    assert runs[1] == runs[0]
    assert any(reason == "stop" for out in runs[0] for _, _, reason, _, _ in out)
