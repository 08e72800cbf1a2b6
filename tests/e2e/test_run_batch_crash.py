"""`nanopaged run-batch` killed with SIGKILL at random moments mid-run, and once resumed over a
torn last line, ends with exactly one whole result per request, equal to an uninterrupted run's."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
from tiny_models import add_byte_tokenizer, add_chat_template, make_tiny_model

from nanopaged import LLM
from nanopaged.entrypoints.run_batch import run_batch

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")

NUM_REQUESTS = 120
# Kills in a fresh run, in a resumed one, and in the run that cut off a torn last line
# (appended by hand before it); the run after them finishes the file.
NUM_KILLS = 3
TORN_BEFORE_RUN = 3  # the run that first finds a torn last line
ENGINE_ARGS = {"kv_cache_memory": 1 << 22, "dtype": "float32", "max_num_seqs": 2}


def _requests() -> str:
    lines = []
    for i in range(NUM_REQUESTS):
        body = {"temperature": 0, "max_tokens": 2 + i % 7}
        if i % 5 == 0:
            url = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": f"question {i}"}]
        else:
            url = "/v1/completions"
            body["prompt"] = f"request {i}: " + "ab" * (i % 9)
        lines.append(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": url, "body": body}))
    return "\n".join(lines) + "\n"


def _num_lines(path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def _answer(record) -> tuple:
    body = record["response"]["body"]
    choice = body["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return text, choice["finish_reason"], body["usage"]


def test_killed_and_resumed_run_equals_an_uninterrupted_one(tmp_path):
    model_dir = make_tiny_model(tmp_path / "llama", "llama", max_position_embeddings=128)
    add_byte_tokenizer(model_dir)
    add_chat_template(
        model_dir, "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<a>"
    )
    inp, out, ref = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "ref.jsonl"
    inp.write_text(_requests())
    counts = run_batch(LLM(str(model_dir), **ENGINE_ARGS), inp, ref, "m", use_tqdm=False)
    assert counts == {"ok": NUM_REQUESTS, "error": 0, "skipped": 0}
    expected = {r["custom_id"]: _answer(r) for r in map(json.loads, ref.read_text().splitlines())}

    cmd = [sys.executable, "-m", "nanopaged", "run-batch", "-i", str(inp), "-o", str(out),
           "--model", str(model_dir), "--disable-progress-bar", "--kv-cache-memory",
           str(ENGINE_ARGS["kv_cache_memory"]), "--dtype", "float32", "--max-num-seqs",
           str(ENGINE_ARGS["max_num_seqs"])]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rng = random.Random(20240611)
    kills, runs = 0, 0
    while True:
        runs += 1
        if runs == TORN_BEFORE_RUN:
            # A record cut short, as a full disk or a power cut leaves it: no newline.
            with out.open("ab") as f:
                f.write(b'{"id": "batch_req_torn", "custom_id": "r119", "response": {"status_c')
        before = _num_lines(out)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        if kills < NUM_KILLS:
            # Kill once this run has written a random few records, a random moment later: mid-
            # run, wherever the run is (serving, writing a record, syncing), and never near the
            # end, so that each kill leaves work for the next run.
            wanted = before + rng.randint(1, 6)
            deadline = time.monotonic() + 120
            while _num_lines(out) < wanted and proc.poll() is None:
                assert time.monotonic() < deadline, "the run wrote nothing in 120 s"
                time.sleep(0.002)
            time.sleep(rng.uniform(0.0, 0.02))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.communicate()
                kills += 1
                continue
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr.decode()[-2000:]
        break
    assert kills == NUM_KILLS and runs > TORN_BEFORE_RUN  # every kill landed mid-run
    # The last run's summary is true: it served what the killed runs had not finished.
    summary = re.search(r"(\d+) served, (\d+) errors, (\d+) already done", stdout.decode())
    served, errors, skipped = map(int, summary.groups())
    records = [json.loads(line) for line in out.read_text().splitlines()]  # all whole JSON
    assert errors == 0 and served + skipped == NUM_REQUESTS and served > 0
    ids = [r["custom_id"] for r in records]
    assert sorted(ids) == sorted(expected)  # each custom_id exactly once, no errors
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in records)
    assert {r["custom_id"]: _answer(r) for r in records} == expected
