"""A tensor-parallel LLM in a script run as its own process: how its workers start (forked,
so no `if __name__ == "__main__":` is needed; spawned, which needs one) and how they end when
the script exits without shutting the LLM down."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from tiny_models import make_tiny_model

from nanopaged import LLM, SamplingParams
from nanopaged.distributed.workers import START_METHOD_ENV

PROMPTS = [[1, 2, 3], list(range(5, 40))]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
KW = "kv_cache_memory=1 << 22"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # A vocabulary of 2048: loading the embedding copies more elements than one OpenMP chunk,
    # so a worker runs parallel regions while it starts.
    return make_tiny_model(tmp_path_factory.mktemp("llama-procs"), "llama", vocab_size=2048)


def _run(script: str, tmp_path, env: dict | None = None, timeout: float = 120):
    path = tmp_path / "script.py"
    path.write_text(script)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **(env or {}))
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          env=env, timeout=timeout)  # fmt: skip


def _generate_lines(model_dir, indent: str, device: str = "cpu") -> str:
    lines = [
        f"llm = LLM({str(model_dir)!r}, tensor_parallel_size=2, device={device!r}, {KW})",
        "params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)",
        f"outs = llm.generate({PROMPTS!r}, params, use_tqdm=False)",
        "print(json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)",
    ]
    return "".join(indent + line + "\n" for line in lines)


@pytest.mark.parametrize(
    "method, guarded", [("fork", False), ("spawn", True)], ids=["fork-unguarded", "spawn-guarded"]
)
def test_script_gives_one_rank_tokens(model_dir, tmp_path, method, guarded):
    """Forked workers (the default on a CPU) run nothing of the script again, so it needs no
    main guard, even though it ran OpenMP work on two threads first (a forked worker's OpenMP
    must not use the pool that lost its threads in the fork); spawned workers work under the
    guard."""
    want = LLM(str(model_dir), kv_cache_memory=1 << 22).generate(PROMPTS, GREEDY, use_tqdm=False)
    header = (
        "import json, os\n"
        "import torch\n"
        "from nanopaged import LLM, SamplingParams\n"
        "os.cpu_count = lambda: 4  # as on 4 cores: each worker runs 2 threads\n"
        "torch.set_num_threads(2)\n"
        "torch.randn(1 << 20).exp().sum()  # this process's OpenMP pool starts\n"
    )
    body = (
        "if __name__ == '__main__':\n" + _generate_lines(model_dir, "    ")
        if guarded
        else _generate_lines(model_dir, "")
    )
    done = _run(header + body, tmp_path, env={START_METHOD_ENV: method})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == [o.outputs[0].token_ids for o in want]


def test_spawn_without_main_guard_is_a_clear_error(model_dir, tmp_path):
    done = _run(
        "from nanopaged import LLM, SamplingParams\nimport json\n" + _generate_lines(model_dir, ""),
        tmp_path,
        env={START_METHOD_ENV: "spawn"},
        timeout=60,
    )
    assert done.returncode == 1
    err = done.stderr
    assert "RuntimeError: tensor-parallel workers start with spawn here" in err, err[-3000:]
    assert 'under `if __name__ == "__main__":`' in err and "script.py" in err
    assert "bootstrapping phase" not in err  # no worker was started


EXIT_SCRIPT = """\
import atexit, json, multiprocessing, threading, time, weakref

procs = []


def report():  # registered first, so it runs last
    print("workers", json.dumps([p.exitcode for p in procs]), flush=True)
    names = sorted(t.name for t in threading.enumerate() if t.name.startswith("nanopaged"))
    print("threads", json.dumps(names), flush=True)


atexit.register(report)
if {finalizer_first}:
    # A finalizer made before multiprocessing is imported: weakref's exit hook, which runs the
    # LLM's finalizer, then runs after multiprocessing's, which terminates daemonic children.
    weakref.finalize(report, lambda: None)

from nanopaged import LLM, SamplingParams

if __name__ == "__main__":
{generate}    procs.extend(multiprocessing.active_children())
    if {generating}:
        # The program ends while a daemon thread is in the middle of its steps.
        def keep_generating():
            while True:
                llm.generate(PROMPTS, params, use_tqdm=False)

        threading.Thread(target=keep_generating, daemon=True).start()
        time.sleep(1.0)
    # no shutdown: the interpreter exits with the LLM alive
"""
EXITS = {
    "llm-alive": dict(finalizer_first=False, generating=False),
    "finalizer-first": dict(finalizer_first=True, generating=False),
    "generating-in-a-thread": dict(finalizer_first=False, generating=True),
}


def _exit_script(model_dir, how: str, device: str = "cpu") -> str:
    generate = f"    PROMPTS = {PROMPTS!r}\n" + _generate_lines(model_dir, "    ", device)
    if device == "cuda":
        generate = generate.replace(KW, "gpu_memory_utilization=0.3")
    return EXIT_SCRIPT.format(generate=generate, **EXITS[how])


def _exits_cleanly(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, done.stderr[-3000:]
    assert "terminate called" not in done.stderr
    # A daemon thread still generating may learn that the workers were stopped, nothing else.
    errors = [line for line in done.stderr.splitlines() if line.split(":")[0].endswith("Error")]
    assert all("tensor-parallel workers were stopped" in line for line in errors), errors
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    # The workers left the group and exited in order (not terminated, -15, or killed, -9),
    # and no thread of the LLM's outlived it.
    codes = json.loads(lines["workers"])
    assert codes and codes == [0] * len(codes)
    assert json.loads(lines["threads"]) == []


@pytest.mark.parametrize("how", list(EXITS))
def test_exit_without_shutdown(model_dir, tmp_path, how):
    _exits_cleanly(_run(_exit_script(model_dir, how), tmp_path))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 CUDA devices")
@pytest.mark.parametrize("how", list(EXITS))
def test_gpu_exit_without_shutdown(model_dir, tmp_path, how):
    """NCCL, CUDA graphs and peer all-reduces: a program that exits with a TP LLM alive, or
    with a generate running in a daemon thread, exits 0 (it aborted, exit code 134, with
    "terminate called after throwing an instance of 'c10::AcceleratorError'" (an illegal
    memory access), or hung, in some runs). Several runs: the failure was a race."""
    script = _exit_script(model_dir, how, device="cuda")
    for _ in range(4 if how == "generating-in-a-thread" else 2):
        _exits_cleanly(_run(script, tmp_path))
