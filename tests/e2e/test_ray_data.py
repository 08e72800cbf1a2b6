"""The Ray Data class on Ray's local cluster gives a plain LLM's greedy outputs."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tiny_models import add_byte_tokenizer, make_tiny_model

from nanopaged import LLM, SamplingParams
from nanopaged.integrations.ray_data import NanopagedPredictor

GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = ["hello there", "the quick brown fox", "a", "paged attention", "one two three four"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("llama-ray"), "llama")
    add_byte_tokenizer(path)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    )
    cfg_path.write_text(json.dumps(cfg))
    return path


def test_predictor_reads_text_and_chat_rows(model_dir):
    """In process: text rows go through generate, message lists through chat, order kept."""
    chat = [{"role": "user", "content": "hi"}]
    batch = {"prompt": np.array(["hello there", chat, "a"], dtype=object), "id": np.arange(3)}
    predictor = NanopagedPredictor(str(model_dir), sampling_params=GREEDY)
    out = predictor(batch)
    llm = LLM(str(model_dir))
    params = SamplingParams(**GREEDY)
    want = llm.generate(["hello there", "a"], params, use_tqdm=False)
    want_chat = llm.chat(chat, params, use_tqdm=False)
    expected = [want[0], want_chat[0], want[1]]
    assert list(out["generated_token_ids"]) == [o.outputs[0].token_ids for o in expected]
    assert list(out["id"]) == [0, 1, 2] and list(out["finish_reason"]) == ["length"] * 3
    with pytest.raises(TypeError, match="row 0"):
        predictor({"prompt": np.array([3], dtype=object)})


def test_ray_data_two_actors_match_plain_llm(model_dir):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        ds = ray.data.from_items([{"prompt": p, "row": i} for i, p in enumerate(PROMPTS)])
        ds = ds.map_batches(
            NanopagedPredictor,
            fn_constructor_kwargs=dict(model=str(model_dir), sampling_params=GREEDY),
            concurrency=2,
            num_cpus=1,
            batch_size=2,
        )
        rows = sorted(ds.take_all(), key=lambda r: r["row"])
    finally:
        ray.shutdown()
    want = LLM(str(model_dir)).generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)
    assert [list(r["generated_token_ids"]) for r in rows] == [
        o.outputs[0].token_ids for o in want
    ]
    assert [r["generated_text"] for r in rows] == [o.outputs[0].text for o in want]
    assert {r["finish_reason"] for r in rows} == {"length"}
