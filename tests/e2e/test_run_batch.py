"""`nanopaged run-batch`: OpenAI batch lines in, result lines out, equal to LLM.chat/generate."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from tiny_models import add_byte_tokenizer, add_chat_template, make_tiny_model

from nanopaged import LLM, SamplingParams
from nanopaged.entrypoints.run_batch import run_batch

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}"
    "{% endif %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
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

    # Resume: lines already answered are skipped; new ones and the errors run again.
    more = _line("cmpl-3", "/v1/completions", {"prompt": "abc", "max_tokens": 2})
    inp.write_text("\n".join([*LINES, more]) + "\n")
    counts = run_batch(llm, inp, out, "m", use_tqdm=False)
    assert counts == {"ok": 1, "error": 3, "skipped": 3}
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


def _cmpl(custom_id, prompt="hello", **body):
    return _line(custom_id, "/v1/completions",
                 {"prompt": prompt, "temperature": 0, "max_tokens": 3, **body})  # fmt: skip


def _final(records):
    """The record a reader keeps for each custom_id: the last one."""
    return {r["custom_id"]: r for r in records}


def _status(record):
    return record["response"]["status_code"]


def test_repeated_custom_id_gets_its_own_error_record(llm, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join([_cmpl("a"), _cmpl("b"), _cmpl("a", "other")]) + "\n")
    counts = run_batch(llm, inp, out, "m", use_tqdm=False)
    assert counts == {"ok": 2, "error": 1, "skipped": 0}
    records = _read(out)
    assert len(records) == 3  # one record per input line
    (dup,) = [r for r in records if r["error"] is not None]
    assert dup["custom_id"] == "a" and _status(dup) == 400
    assert "line 3" in dup["error"]["message"] and "'a'" in dup["error"]["message"]
    assert "line 1" in dup["error"]["message"]
    # The served request's record comes after the duplicate's error, so the last one wins.
    assert _status(_final(records)["a"]) == 200

    # The duplicate's error never marks "a" done: without a's result, a rerun serves it.
    out.write_text("".join(json.dumps(r) + "\n" for r in records if _status(r) != 200))
    counts = run_batch(llm, inp, out, "m", use_tqdm=False)
    assert counts == {"ok": 2, "error": 1, "skipped": 0}
    assert all(_status(r) == 200 for cid, r in _final(_read(out)).items())

    counts = run_batch(llm, inp, out, "m", use_tqdm=False)
    assert counts == {"ok": 0, "error": 0, "skipped": 3}


def test_resume_cuts_a_torn_last_line_and_never_trusts_bad_lines(llm, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(_cmpl(cid) for cid in "abcd") + "\n")
    run_batch(llm, inp, out, "m", use_tqdm=False)
    by_id = _final(_read(out))
    # a: a line that is not valid JSON; b: valid JSON, but no status-200 record;
    # c: a good record; d: torn in the middle of its line (a kill, a full disk).
    torn = json.dumps(by_id["d"])
    out.write_text(
        json.dumps(by_id["a"])[:-1] + "\n"
        + json.dumps({"custom_id": "b"}) + "\n"
        + json.dumps(by_id["c"]) + "\n"
        + torn[: len(torn) // 2]
    )  # fmt: skip
    counts = run_batch(llm, inp, out, "m", use_tqdm=False)
    assert counts == {"ok": 3, "error": 0, "skipped": 1}
    lines = out.read_text().splitlines()
    # The torn fragment is gone; the two bad lines stay as they were, never counted as done.
    assert len(lines) == 2 + 1 + 3 and json.loads(lines[1]) == {"custom_id": "b"}
    good = [json.loads(line) for line in lines[2:]]  # every line from c on is whole
    assert sorted(r["custom_id"] for r in good) == ["a", "b", "c", "d"]
    assert all(_status(r) == 200 for r in good)
    for r in good:
        assert r["response"]["body"]["choices"] == by_id[r["custom_id"]]["response"]["body"][
            "choices"]  # fmt: skip


BAD_LINES = {
    "invalid UTF-8": (
        b'{"custom_id": "u", "method": "POST", "url": "/v1/completions", '
        b'"body": {"prompt": "caf\xe9"}}',
        "not valid UTF-8",
    ),
    "nested too deeply": (
        b'{"custom_id": "deep", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "nested",
    ),
    "chat template raises": (
        _line("tool", "/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]})
        .encode(),
        "tool messages are not supported",
    ),
}


@pytest.mark.parametrize("kind", list(BAD_LINES))
def test_a_bad_line_is_one_error_record_and_the_rest_are_served(llm, tmp_path, kind):
    bad, message = BAD_LINES[kind]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes(_cmpl("first").encode() + b"\n" + bad + b"\n" + _cmpl("last").encode() + b"\n")
    counts = run_batch(llm, inp, out, "m", use_tqdm=False)
    assert counts == {"ok": 2, "error": 1, "skipped": 0}
    records = _read(out)
    (err,) = [r for r in records if r["error"] is not None]
    assert _status(err) == 400
    assert err["error"]["message"].startswith("line 2: ") and message in err["error"]["message"]
    assert sorted(r["custom_id"] for r in records if _status(r) == 200) == ["first", "last"]


def test_results_are_written_and_counted_as_each_request_finishes(llm, tmp_path, monkeypatch):
    """A request that finishes early has its record on disk (flushed, fsynced) and on the
    progress bar while a longer one still runs."""
    from nanopaged.entrypoints import run_batch as rb

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    # logit_bias forces a token that is not EOS, so "long" runs all its 40 tokens.
    inp.write_text(_cmpl("long", max_tokens=40, logit_bias={"9": 100}) + "\n"
                   + _cmpl("short", max_tokens=1) + "\n")  # fmt: skip
    bars = []

    class Bar:
        def __init__(self, *args, **kwargs):
            self.n = 0
            bars.append(self)

        def update(self, k=1):
            self.n += k

        def close(self):
            pass

    fsyncs = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), real_fsync(fd))[1])
    monkeypatch.setattr(rb, "tqdm", Bar)
    monkeypatch.setattr(rb, "FSYNC_EVERY", 1, raising=False)
    seen = []
    schedule = llm.scheduler.schedule

    def spying_schedule():
        text = out.read_text() if out.exists() else ""
        seen.append(([json.loads(x)["custom_id"] for x in text.splitlines()], bars[0].n,
                     len(fsyncs)))  # fmt: skip
        return schedule()

    monkeypatch.setattr(llm.scheduler, "schedule", spying_schedule)
    counts = run_batch(llm, inp, out, "m", use_tqdm=True)
    assert counts == {"ok": 2, "error": 0, "skipped": 0}
    # While "long" still ran, "short" was written, counted and fsynced.
    assert (["short"], 1) in [(ids, n) for ids, n, _ in seen]
    fsyncs_at_start = seen[0][2]
    assert any(ids == ["short"] and n > fsyncs_at_start for ids, _, n in seen)
    assert [r["custom_id"] for r in _read(out)] == ["short", "long"]
    assert bars[0].n == 2


def test_a_refused_request_does_not_split_the_batch(llm, tmp_path, monkeypatch):
    """Requests the model refuses (too long, too many logprobs) become 400 records; the others
    are served together by one engine call, as they are without the refused ones."""
    prompts = ["hello", "abc", [5, 6, 7], "a longer prompt"]
    lines = [_cmpl(f"ok-{i}", p, max_tokens=4) for i, p in enumerate(prompts)]
    lines.insert(1, _cmpl("too-long", list(range(1, 201))))
    lines.insert(3, _cmpl("many-logprobs", logprobs=21))
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    calls = []
    for name in ("generate", "chat", "generate_iter"):
        if hasattr(llm, name):
            method = getattr(llm, name)
            monkeypatch.setattr(llm, name, lambda *a, _m=method, _n=name, **k: (
                calls.append(_n), _m(*a, **k))[1])  # fmt: skip
    counts = run_batch(llm, inp, out, "m", use_tqdm=False)
    assert len(calls) == 1
    assert counts == {"ok": 4, "error": 2, "skipped": 0}
    by_id = _final(_read(out))
    assert "max_model_len=128" in by_id["too-long"]["error"]["message"]
    assert "max_logprobs=20" in by_id["many-logprobs"]["error"]["message"]
    monkeypatch.undo()
    expected = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    for i, e in enumerate(expected):
        assert by_id[f"ok-{i}"]["response"]["body"]["choices"][0]["text"] == e.outputs[0].text


def test_error_records_are_served_again_on_resume(llm, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(_cmpl("a") + "\n" + _cmpl("b", temperature=-1) + "\n")
    assert run_batch(llm, inp, out, "m", use_tqdm=False) == {"ok": 1, "error": 1, "skipped": 0}
    inp.write_text(_cmpl("a") + "\n" + _cmpl("b") + "\n")  # the user fixes line 2
    assert run_batch(llm, inp, out, "m", use_tqdm=False) == {"ok": 1, "error": 0, "skipped": 1}
    records = _read(out)
    assert [_status(r) for r in records if r["custom_id"] == "a"] == [200]
    # The old error stays; the new record comes after it, so a reader keeping the last wins.
    assert [_status(r) for r in records if r["custom_id"] == "b"] == [400, 200]


def test_max_logprobs_option(model_dir, tmp_path, monkeypatch):
    """logprobs past the engine's max_logprobs are a 400 naming it; --max-logprobs raises it."""
    from nanopaged.entrypoints import cli

    inp = tmp_path / "in.jsonl"
    inp.write_text(_line("c", "/v1/chat/completions",
                         {"messages": CONV, "max_tokens": 2, "temperature": 0,
                          "logprobs": True, "top_logprobs": 25}) + "\n")  # fmt: skip
    argv = ["run-batch", "-i", str(inp), "--model", str(model_dir), "--kv-cache-memory",
            str(1 << 22), "--dtype", "float32", "--disable-progress-bar"]  # fmt: skip
    assert cli.main([*argv, "-o", str(tmp_path / "default.jsonl")]) == 0
    (record,) = _read(tmp_path / "default.jsonl")
    assert _status(record) == 400 and "max_logprobs=20" in record["error"]["message"]
    assert cli.main([*argv, "-o", str(tmp_path / "raised.jsonl"), "--max-logprobs", "30"]) == 0
    (record,) = _read(tmp_path / "raised.jsonl")
    assert _status(record) == 200
    content = record["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert [len(c["top_logprobs"]) for c in content] == [25, 25]


def test_ctrl_c_mid_run_keeps_finished_records_and_the_llm_usable(llm, tmp_path, monkeypatch):
    from nanopaged.entrypoints import run_batch as rb

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(_cmpl(f"r{i}", max_tokens=1 + i) for i in range(4)) + "\n")
    real_body, bodies = rb.response_body, []

    def interrupted_body(*args):
        if len(bodies) == 2:
            raise KeyboardInterrupt
        bodies.append(real_body(*args))
        return bodies[-1]

    monkeypatch.setattr(rb, "response_body", interrupted_body)
    with pytest.raises(KeyboardInterrupt) as interrupted:
        run_batch(llm, inp, out, "m", use_tqdm=False)
    # While the traceback (and so run_batch's frame) lives on, the LLM serves: the requests
    # left were aborted and their blocks freed when run_batch was left, not at collection.
    assert interrupted.tb is not None and llm.kv_stats().num_used_blocks == 0
    llm.generate("abc", SamplingParams(max_tokens=2), use_tqdm=False)
    assert [r["custom_id"] for r in _read(out)] == ["r0", "r1"]
    monkeypatch.undo()
    assert run_batch(llm, inp, out, "m", use_tqdm=False) == {"ok": 2, "error": 0, "skipped": 2}
