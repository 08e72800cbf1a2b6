"""LLM.generate's API: prompt forms, seeds, stop strings, min_tokens, EOS, validation."""

from __future__ import annotations

import json

import pytest
from tiny_models import make_tiny_model

from nanopaged import LLM, SamplingParams


@pytest.fixture(scope="module")
def model_dir(byte_llama):
    return byte_llama


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), kv_cache_memory=1 << 22)


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_prompt_forms(llm):
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ids = llm.tokenizer.encode("hello there")
    by_text = llm.generate("hello there", greedy, use_tqdm=False)
    by_ids = llm.generate(ids, greedy, use_tqdm=False)
    by_lists = llm.generate([ids, ids[:3]], greedy, use_tqdm=False)
    assert len(by_text) == len(by_ids) == 1 and len(by_lists) == 2
    assert _tokens(by_text) == _tokens(by_ids) == _tokens(by_lists)[:1]
    assert by_text[0].prompt == "hello there" and by_ids[0].prompt is None
    assert by_text[0].prompt_token_ids == ids
    assert by_text[0].outputs[0].text == llm.tokenizer.decode(by_text[0].outputs[0].token_ids)
    assert by_text[0].finished
    assert by_lists[0].request_id != by_lists[1].request_id


def test_per_prompt_params_keep_input_order(llm):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (7, 2, 4)]
    outs = llm.generate([[1, 2, 3], [4, 5], [6]], params, use_tqdm=False)
    assert [len(t) for t in _tokens(outs)] == [7, 2, 4]
    assert [o.prompt_token_ids for o in outs] == [[1, 2, 3], [4, 5], [6]]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16,
                       ignore_eos=True)  # fmt: skip
    prompt = [10, 20, 30, 40]
    alone = _tokens(llm.generate([prompt], p, use_tqdm=False))[0]
    others = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    crowd = llm.generate(
        [[7] * 30, prompt, [8, 9]], [others, p, others], use_tqdm=False
    )
    assert _tokens(crowd)[1] == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=16,
                                ignore_eos=True)  # fmt: skip
    assert _tokens(llm.generate([prompt], other_seed, use_tqdm=False))[0] != alone


def test_stop_strings(llm):
    free = llm.block_manager.num_free_blocks
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = llm.generate("abc", base, use_tqdm=False)[0].outputs[0]
    stop = full.text[10:13]
    cut = full.text.find(stop)
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop, "\x00never"])
    out = llm.generate("abc", p, use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < len(full.token_ids)
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    p.include_stop_str_in_output = True
    kept = llm.generate("abc", p, use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[: cut + len(stop)]
    assert llm.block_manager.num_free_blocks == free


def test_logprobs_are_made_when_read(llm, monkeypatch):
    """generate and beam_search hand back logprobs whose Logprob objects and token texts are
    made for a position when it is first read."""
    import pickle

    import nanopaged.outputs
    from nanopaged import BeamSearchParams, Logprob

    made = []

    class SpyLogprob(Logprob):
        def __init__(self, *args, **kwargs):
            made.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(nanopaged.outputs, "Logprob", SpyLogprob)
    p = SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=12, logprobs=3, ignore_eos=True)
    outs = llm.generate(["abc", "hello"], p, use_tqdm=False)
    beams = llm.beam_search([{"prompt_token_ids": [1, 2, 3]}], BeamSearchParams(2, 5))
    assert made == []
    c = outs[1].outputs[1]
    last = c.logprobs[-1]
    assert len(made) == len(last) and c.token_ids[-1] in last and len(last) in (3, 4)
    assert all(lp.decoded_token == llm.tokenizer.decode([t]) for t, lp in last.items())
    assert sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs)) == pytest.approx(
        c.cumulative_logprob, abs=1e-4
    )
    best = beams[0].sequences[0]
    assert [list(d) for d in best.logprobs] == [[t] for t in best.tokens[3:]]
    monkeypatch.undo()  # a class local to this test does not pickle
    again = llm.generate(["abc", "hello"], p, use_tqdm=False)
    # Logprob equality compares decoded_token too: the texts travel without the tokenizer.
    assert pickle.loads(pickle.dumps(again)) == again


def test_eos_and_min_tokens(model_dir, tmp_path):
    # Make the greedy first token the model's EOS, then check stop / ignore / min_tokens.
    probe = LLM(str(model_dir), kv_cache_memory=1 << 22)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = _tokens(probe.generate([[5, 6, 7]], greedy, use_tqdm=False))[0]
    eos = first[0]
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        cfg = json.loads(path.read_text())
        cfg["eos_token_id"] = eos
        (tmp_path / name).write_text(json.dumps(cfg))
    for f in model_dir.iterdir():
        if not (tmp_path / f.name).exists():
            (tmp_path / f.name).symlink_to(f)
    llm = LLM(str(tmp_path), kv_cache_memory=1 << 22)
    assert eos in llm.eos_token_ids
    stopped = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8),
                           use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert stopped.token_ids == [eos] and stopped.finish_reason == "stop"
    assert stopped.stop_reason is None
    ignored = llm.generate([[5, 6, 7]], greedy, use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == first and ignored.finish_reason == "length"
    p = SamplingParams(temperature=0, max_tokens=8, min_tokens=4, stop_token_ids=[eos])
    late = llm.generate([[5, 6, 7]], p, use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) >= 4 and eos not in late.token_ids[:4]


def test_text_prompt_without_tokenizer(tmp_path):
    path = make_tiny_model(tmp_path / "qwen2", "qwen2")
    llm = LLM(str(path), kv_cache_memory=1 << 22)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello", use_tqdm=False)
    out = llm.generate([1, 2, 3], SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].text == ""


@pytest.mark.parametrize(
    "prompts, params, error, match",
    [
        ([[]], None, ValueError, "empty"),
        ([[1, 2, 600]], None, ValueError, "vocabulary"),
        ([list(range(5))] * 2, [SamplingParams()], ValueError, "1 entries but there are 3"),
        ([1.5], None, TypeError, "prompts"),
        (["hi"], ["a", "b"], TypeError, "sampling_params"),
        ([[1] * 1025], None, ValueError, "max_model_len"),
    ],
)
def test_bad_input_is_refused_before_work(llm, prompts, params, error, match):
    good = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = _tokens(llm.generate([[3, 1, 4, 1, 5]], good, use_tqdm=False))
    with pytest.raises(error, match=match):
        llm.generate([[3, 1, 4, 1, 5]] + prompts, params, use_tqdm=False)
    assert not llm.scheduler.has_unfinished()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert _tokens(llm.generate([[3, 1, 4, 1, 5]], good, use_tqdm=False)) == before
