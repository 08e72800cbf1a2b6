"""vLLM's engine API: EngineArgs (and its command line), LLMEngine's add_request / step /
abort_request, partial outputs (cumulative and delta), hf_overrides."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil

import pytest

from nanopaged import LLM, EngineArgs, LLMEngine, RequestOutputKind, SamplingParams
from nanopaged.utils import FlexibleArgumentParser

KV = 1 << 20


@pytest.fixture(scope="module")
def model_dir(byte_llama):
    return byte_llama


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLMEngine.from_engine_args(
        EngineArgs(model=str(model_dir), kv_cache_memory=KV, max_model_len=256)
    )


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), kv_cache_memory=KV, max_model_len=256)


def _idle(engine: LLMEngine) -> bool:
    bm = engine.block_manager
    return not engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks


JOBS = [
    ("hello there", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
    ([5, 6, 7, 8], SamplingParams(temperature=0.9, top_p=0.9, seed=4, max_tokens=9)),
    ("abc", SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=7, logprobs=2)),
    ([9] * 40, SamplingParams(n=2, best_of=4, temperature=0.7, seed=2, max_tokens=5)),
    ("stop me", SamplingParams(temperature=0, max_tokens=20, stop=["a"], ignore_eos=True)),
]


def test_step_loop_equals_generate(engine, llm):
    want = llm.generate([p for p, _ in JOBS], [sp for _, sp in JOBS], use_tqdm=False)
    finals = {}
    pending = list(enumerate(JOBS))
    while pending or engine.has_unfinished_requests():
        if pending:  # one request joins per step, as vLLM's llm_engine_example does
            i, (prompt, sp) = pending.pop(0)
            engine.add_request(f"r{i}", prompt, dataclasses.replace(
                sp, output_kind=RequestOutputKind.FINAL_ONLY))  # fmt: skip
        for out in engine.step():
            assert out.finished and out.request_id not in finals
            finals[out.request_id] = out
    assert sorted(finals) == [f"r{i}" for i in range(len(JOBS))]
    for i, w in enumerate(want):
        got = finals[f"r{i}"]
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in w.outputs]
        assert [c.text for c in got.outputs] == [c.text for c in w.outputs]
        assert [c.finish_reason for c in got.outputs] == [c.finish_reason for c in w.outputs]
    assert _idle(engine)


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_partial_outputs_add_up_to_the_final_one(engine, kind):
    params = [dataclasses.replace(sp, output_kind=kind) for _, sp in JOBS]
    for i, ((prompt, _), sp) in enumerate(zip(JOBS, params)):
        engine.add_request(f"p{i}", prompt, sp)
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    for i, (_, sp) in enumerate(JOBS):
        outs = seen[f"p{i}"]
        final = outs[-1]
        assert final.finished and not any(o.finished for o in outs[:-1])
        if sp.best_of:  # picks its samples at the end: the final output only
            assert len(outs) == 1
            continue
        assert len(outs) > 2  # reported while it ran
        for j in range(sp.n):
            if kind == RequestOutputKind.DELTA:
                tokens = [t for o in outs for c in o.outputs if c.index == j for t in c.token_ids]
                text = "".join(c.text for o in outs for c in o.outputs if c.index == j)
                whole = tokens
            else:
                # Each report extends the one before it.
                texts = [c.text for o in outs for c in o.outputs if c.index == j]
                assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
                whole, text = final.outputs[j].token_ids, final.outputs[j].text
            ref = engine.output_builder.decode(whole, True)
            cut = ref.find("a") if sp.stop else -1  # cut at a stop string, never shown past it
            assert text == (ref if cut < 0 else ref[:cut])
    assert _idle(engine)


def test_abort_frees_every_block(engine):
    sp = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"a{i}", [i + 1] * 30, dataclasses.replace(sp, n=1 + i % 2))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    engine.abort_request(["a0", "a2", "not-a-request"])
    assert engine.get_num_unfinished_requests() == 2
    engine.abort_request("a1")
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["a3"] and len(outs[0].outputs[0].token_ids) == 60
    assert _idle(engine)
    engine.add_request("a3", [1, 2], sp)  # its id is free again
    engine.abort_request("a3")
    assert _idle(engine) and engine.reset_prefix_cache()
    assert not engine.block_manager.hash_to_block


def test_add_request_refuses_before_queueing(engine):
    bad = SamplingParams()
    bad.top_p = 2.0  # after construction: only the engine's own check can catch it
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        engine.add_request("x", "hi", bad)
    with pytest.raises(ValueError, match=r"is empty"):
        engine.add_request("x", [], None)
    with pytest.raises(TypeError, match=r"request_id must be a str"):
        engine.add_request(3, "hi")
    engine.add_request("dup", "hi", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"request_id 'dup' is already running"):
        engine.add_request("dup", "hi")
    engine.abort_request("dup")
    assert _idle(engine)


def test_engine_args_round_trip_through_argparse(model_dir):
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args([
        "--model", str(model_dir), "--max-model-len", "128", "--kv_cache_memory", str(KV),
        "--no-enable-prefix-caching", "--enforce-eager", "--dtype", "float32",
        "--hf-overrides", '{"rms_norm_eps": 1e-5}', "--async-scheduling",
    ])  # fmt: skip
    ea = EngineArgs.from_cli_args(args)
    assert ea == EngineArgs(model=str(model_dir), max_model_len=128, kv_cache_memory=KV,
                            enable_prefix_caching=False, enforce_eager=True, dtype="float32",
                            hf_overrides={"rms_norm_eps": 1e-5}, async_scheduling=True)  # fmt: skip
    assert EngineArgs.from_cli_args(parser.parse_args([])) == EngineArgs()
    # Into an argument group too, as vLLM's examples add them.
    outer = argparse.ArgumentParser()
    EngineArgs.add_cli_args(outer.add_argument_group("engine"))
    assert vars(outer.parse_args(["--seed", "7"]))["seed"] == 7
    llm = LLM.from_engine_args(ea)
    assert llm.max_model_len == 128 and not llm.config.enable_prefix_caching
    assert llm.model_config.rms_norm_eps == 1e-5


def test_hf_overrides_equal_an_edited_config(model_dir, tmp_path, llm):
    edited = tmp_path / "edited"
    shutil.copytree(model_dir, edited)
    cfg = json.loads((edited / "config.json").read_text())
    rope = {"rope_type": "default", "rope_theta": 50.0}
    cfg["rope_parameters"] = rope
    (edited / "config.json").write_text(json.dumps(cfg))
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6] * 4]
    over = LLM(str(model_dir), kv_cache_memory=KV, hf_overrides={"rope_parameters": rope})
    ref = LLM(str(edited), kv_cache_memory=KV)

    def run(m: LLM) -> tuple[list[int], float]:
        out = m.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
        return out.token_ids, out.cumulative_logprob

    got = run(over)
    assert got == run(ref)
    assert got[1] != run(llm)[1]  # the override changed the model
    with pytest.raises(ValueError, match=r"num_hidden_layers .*hf_overrides"):
        LLM(str(model_dir), kv_cache_memory=KV, hf_overrides={"num_hidden_layers": 0})
    with pytest.raises(TypeError, match=r"hf_overrides must be a dict"):
        LLM(str(model_dir), kv_cache_memory=KV, hf_overrides=[("rope_theta", 1.0)])


def test_generate_iter_partial_reports_progress(llm):
    prompts = ["one", "two two"]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True,
                             output_kind=RequestOutputKind.DELTA) for m in (6, 3)]  # fmt: skip
    got: dict[int, list[int]] = {0: [], 1: []}
    finals = []
    for i, out in llm.generate_iter(prompts, params, partial=True):
        got[i] += out.outputs[0].token_ids
        if out.finished:
            finals.append(i)
    want = llm.generate(prompts, params, use_tqdm=False)
    assert finals == [1, 0]
    assert [got[0], got[1]] == [w.outputs[0].token_ids for w in want]
