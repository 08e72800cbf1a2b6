"""Ray Data replicas: a plain LLM's greedy outputs, CPU reservations that let a 2-CPU local
cluster finish with two replicas, and a clear error for more replicas than it holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tiny_models import add_byte_tokenizer, add_chat_template, make_tiny_model

from nanopaged import LLM, SamplingParams
from nanopaged.integrations.ray_data import (
    ClusterTooSmall,
    NanopagedPredictor,
    actor_pool_args,
    add_generations,
    io_args,
    replicas_that_fit,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ray_data_batch.py"
GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
CHAT = [{"role": "user", "content": "hi"}]
PROMPTS = ["hello there", "the quick brown fox", "a", "paged attention", "one two three four",
           "blocks", "x y z", "tables", "slot mapping", "kv", "decode", "prefill"]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("llama-ray"), "llama")
    add_byte_tokenizer(path)
    add_chat_template(path, TEMPLATE)
    return path


def test_predictor_reads_text_and_chat_rows(model_dir):
    """In process: text rows go through generate, message lists through chat, order kept."""
    batch = {"prompt": np.array(["hello there", CHAT, "a"], dtype=object), "id": np.arange(3)}
    predictor = NanopagedPredictor(str(model_dir), sampling_params=GREEDY)
    out = predictor(batch)
    llm = LLM(str(model_dir))
    params = SamplingParams(**GREEDY)
    want = llm.generate(["hello there", "a"], params, use_tqdm=False)
    want_chat = llm.chat(CHAT, params, use_tqdm=False)
    expected = [want[0], want_chat[0], want[1]]
    assert list(out["generated_token_ids"]) == [o.outputs[0].token_ids for o in expected]
    assert list(out["id"]) == [0, 1, 2] and list(out["finish_reason"]) == ["length"] * 3
    with pytest.raises(TypeError, match="row 0"):
        predictor({"prompt": np.array([3], dtype=object)})


def test_predictor_chat_sends_text_as_a_user_message(model_dir):
    """chat=True: a text row is the user message of a chat, rendered by the template."""
    batch = {"prompt": np.array(["hello there", CHAT], dtype=object)}
    predictor = NanopagedPredictor(
        str(model_dir), sampling_params=GREEDY, chat=True, replica_column="replica"
    )
    out = predictor(batch)
    convs = [[{"role": "user", "content": "hello there"}], CHAT]
    want = LLM(str(model_dir)).chat(convs, SamplingParams(**GREEDY), use_tqdm=False)
    assert list(out["generated_token_ids"]) == [o.outputs[0].token_ids for o in want]
    assert list(out["replica"]) == [f"{os.uname().nodename}:{os.getpid()}"] * 2
    with pytest.raises(TypeError, match="chat must be a bool"):
        NanopagedPredictor(str(model_dir), chat="yes")


def test_replicas_fit_per_node():
    """A replica's resources come from one node: two 3-CPU nodes hold two 2-CPU replicas."""
    nodes = [{"CPU": 3.0}, {"CPU": 3.0, "GPU": 2.0}]
    assert replicas_that_fit(nodes, {"CPU": 2.0}) == 2
    assert replicas_that_fit(nodes, {"CPU": 1.0}) == 6
    assert replicas_that_fit(nodes, {"CPU": 0.5, "GPU": 1.0}) == 2
    assert replicas_that_fit(nodes, {"CPU": 0.5, "GPU": 4.0}) == 0


def test_actor_pool_in_each_ray_api():
    """compute=ActorPoolStrategy from Ray 2.51 (concurrency= deprecated), concurrency= before."""
    pytest.importorskip("ray")
    assert actor_pool_args(3, (2, 50)) == {"concurrency": 3}
    new = actor_pool_args(3, (2, 51))
    assert list(new) == ["compute"] and new["compute"].min_size == new["compute"].max_size == 3


def test_io_args_reserve_no_cpu_in_each_form():
    """num_cpus= where a read takes it (Ray deprecates ray_remote_args there), else
    ray_remote_args=."""

    def new_read(paths, *, num_cpus=None, ray_remote_args=None): ...

    def write(path, *, ray_remote_args=None): ...

    assert io_args(new_read) == {"num_cpus": 0}
    assert io_args(write) == {"ray_remote_args": {"num_cpus": 0}}


def test_bad_arguments_fail_before_ray_starts():
    ray = pytest.importorskip("ray")
    started = ray.is_initialized()
    bad = [({"concurrency": 0}, "concurrency"), ({"num_threads": 1.5}, "num_threads"),
           ({"batch_size": True}, "batch_size")]  # fmt: skip
    for kwargs, field in bad:
        with pytest.raises(ValueError, match=field):
            add_generations(None, **kwargs)
    assert ray.is_initialized() == started


def test_gpu_replicas_reserve_their_gpus_and_half_a_cpu():
    """On a cluster with GPUs (declared, none needed) a replica takes tensor_parallel_size GPUs
    of one node; the check runs before Ray Data does anything."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False)
    try:
        ds = ray.data.from_items([{"prompt": "a"}])
        with pytest.raises(ClusterTooSmall, match=r"0.5 CPU, 2 GPU each .* at most 1 fit"):
            add_generations(ds, concurrency=2, tensor_parallel_size=2)
        add_generations(ds, concurrency=1, tensor_parallel_size=2)
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def two_cpu_cluster():
    """Ray's local cluster with 2 CPUs; the example joins it through RAY_ADDRESS."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, ignore_reinit_error=True)
    try:
        yield ray, ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def _run_example(address: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, RAY_ADDRESS=address, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    # Rows go out once both replicas are up, so the first one cannot take them all while the
    # second still loads its model.
    env["RAY_DATA_DEFAULT_WAIT_FOR_MIN_ACTORS_S"] = "120"
    # A replica that can never be placed hangs Ray Data; the timeout turns that into a failure.
    return subprocess.run(
        [sys.executable, str(EXAMPLE), *args], env=env, capture_output=True, text=True,
        timeout=150,
    )  # fmt: skip


def test_example_too_many_replicas_is_an_error_before_any_model_loads(
    model_dir, two_cpu_cluster, tmp_path
):
    ray, address = two_cpu_cluster
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a"}) + "\n")
    out = tmp_path / "out"
    args = ["--input", str(prompts), "--output", str(out), "--model", str(model_dir)]
    run = _run_example(address, *args, "--concurrency", "8")
    assert run.returncode != 0
    assert "ValueError: --concurrency 8" in run.stderr and "cluster of 2 CPU" in run.stderr
    assert "at most 2 fit" in run.stderr
    # Nothing ran: no output, and no actor ever held a CPU of the cluster.
    assert not out.exists() and "NanopagedPredictor" not in run.stderr
    assert ray.available_resources().get("CPU") == 2


def test_example_two_replicas_on_two_cpus_serve_rows(model_dir, two_cpu_cluster, tmp_path):
    """Two replicas hold both CPUs; reads and writes still run, and both replicas serve rows."""
    _, address = two_cpu_cluster
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"row": i, "prompt": p} for i, p in enumerate(PROMPTS)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    run = _run_example(
        address, "--input", str(prompts), "--output", str(out), "--model", str(model_dir),
        "--output-format", "json", "--concurrency", "2", "--batch-size", "1",
        "--max-tokens", str(GREEDY["max_tokens"]), "--replica-column", "replica",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    assert "``concurrency`` is deprecated" not in run.stderr
    assert "`ray_remote_args` is deprecated" not in run.stderr
    got = [json.loads(line) for f in sorted(out.iterdir()) for line in f.read_text().splitlines()]
    got.sort(key=lambda r: r["row"])
    assert [r["row"] for r in got] == list(range(len(PROMPTS)))
    params = SamplingParams(temperature=0, max_tokens=GREEDY["max_tokens"])
    want = LLM(str(model_dir)).generate(PROMPTS, params, use_tqdm=False)
    assert [r["generated_token_ids"] for r in got] == [o.outputs[0].token_ids for o in want]
    assert [r["finish_reason"] for r in got] == [o.outputs[0].finish_reason for o in want]
    assert len({r["replica"] for r in got}) == 2
