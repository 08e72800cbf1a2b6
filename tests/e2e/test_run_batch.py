"""`nanopaged run-batch`: OpenAI batch lines in, result lines out, equal to LLM.chat/generate."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from tiny_models import add_byte_tokenizer, add_chat_template, make_tiny_model

from nanopaged import LLM, SamplingParams
from nanopaged.entrypoints.run_batch import run_batch

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
CONV = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", max_position_embeddings=128)
    add_byte_tokenizer(path)
    add_chat_template(path, CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), kv_cache_memory=1 << 22, dtype="float32")


def _line(custom_id, url, body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


LINES = [
    _line("chat-1", "/v1/chat/completions",
          {"model": "m", "messages": CONV, "temperature": 0, "max_completion_tokens": 6}),
    _line("cmpl-1", "/v1/completions",
          {"model": "m", "prompt": "hello", "temperature": 0, "max_tokens": 5, "logprobs": 2}),
    "{not json",
    _line("bad-url", "/v1/embeddings", {"input": "x"}),
    _line("bad-temp", "/v1/completions", {"prompt": "x", "temperature": -1}),
    _line("cmpl-2", "/v1/completions",
          {"prompt": [5, 6, 7], "temperature": 0, "max_tokens": 4, "n": 2,
           "logit_bias": {"9": 100}}),
]  # fmt: skip


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_run_batch_equals_llm_and_resumes(llm, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(LINES) + "\n")
    counts = run_batch(llm, inp, out, "m", use_tqdm=False)
    assert counts == {"ok": 3, "error": 3, "skipped": 0}
    records = _read(out)
    assert len(records) == len(LINES)
    by_id = {r["custom_id"]: r for r in records}

    chat = by_id["chat-1"]["response"]
    assert chat["status_code"] == 200 and by_id["chat-1"]["error"] is None
    expected = llm.chat(CONV, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    body = chat["body"]
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant",
                                             "content": expected.outputs[0].text}  # fmt: skip
    assert body["usage"] == {
        "prompt_tokens": len(expected.prompt_token_ids),
        "completion_tokens": 6,
        "total_tokens": len(expected.prompt_token_ids) + 6,
    }

    cmpl = by_id["cmpl-1"]["response"]["body"]
    expected = llm.generate("hello", SamplingParams(temperature=0, max_tokens=5, logprobs=2),
                            use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert cmpl["object"] == "text_completion"
    assert cmpl["choices"][0]["text"] == expected.text
    lp = cmpl["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == pytest.approx(
        [d[t].logprob for t, d in zip(expected.token_ids, expected.logprobs)]
    )
    # Keyed by text, as OpenAI's format is: two ids decoding alike share an entry.
    assert all(1 <= len(d) <= 2 for d in lp["top_logprobs"])

    two = by_id["cmpl-2"]["response"]["body"]
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert all(c["text"] == llm.tokenizer.decode([9] * 4) for c in two["choices"])

    # Bad lines: a status-400 record with a message each, in input order, not a crash.
    errors = [r for r in records if r["error"] is not None]
    assert [r["custom_id"] for r in errors] == [None, "bad-url", "bad-temp"]
    assert all(r["response"]["status_code"] == 400 for r in errors)
    assert "line 3: not valid JSON" in errors[0]["error"]["message"]
    assert "url must be" in errors[1]["error"]["message"]
    assert "temperature" in errors[2]["error"]["message"]

    # Resume: lines already answered are skipped; only new ones (and the id-less bad line) run.
    more = _line("cmpl-3", "/v1/completions", {"prompt": "abc", "max_tokens": 2})
    inp.write_text("\n".join([*LINES, more]) + "\n")
    counts = run_batch(llm, inp, out, "m", use_tqdm=False)
    assert counts == {"ok": 1, "error": 1, "skipped": 5}
    ids = [r["custom_id"] for r in _read(out)]
    assert ids.count("chat-1") == 1 and ids.count("cmpl-3") == 1


def test_run_batch_command_line(model_dir, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(LINES[1] + "\n")
    cmd = [sys.executable, "-m", "nanopaged", "run-batch", "-i", str(inp), "-o", str(out),
           "--model", str(model_dir), "--kv-cache-memory", str(1 << 22), "--dtype", "float32",
           "--disable-progress-bar"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "1 served, 0 errors" in proc.stdout
    (record,) = _read(out)
    assert record["custom_id"] == "cmpl-1" and record["response"]["status_code"] == 200


def test_run_batch_kv_options_reach_the_engine(model_dir, tmp_path, monkeypatch):
    """--kv-cache-dtype fp8 --calculate-kv-scales: the engine serves with an 8-bit cache whose
    scales its first pass calculated."""
    from nanopaged.entrypoints import cli
    from nanopaged.entrypoints import run_batch as rb

    made = []

    class Recording(rb.LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(LINES[1] + "\n")
    argv = ["run-batch", "-i", str(inp), "-o", str(out), "--model", str(model_dir),
            "--kv-cache-memory", str(1 << 22), "--dtype", "float32", "--disable-progress-bar",
            "--kv-cache-dtype", "fp8", "--calculate-kv-scales"]  # fmt: skip
    monkeypatch.setattr(rb, "LLM", Recording)
    assert cli.main(argv) == 0
    (llm,) = made
    assert llm.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert llm.runner.first_kv_pass is None and (llm.runner.kv_scales != 1.0).all()
    (record,) = _read(out)
    assert record["response"]["status_code"] == 200
