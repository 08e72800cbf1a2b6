"""Regressions under memory pressure and from untrusted model files: each test failed before
the fix it names."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import add_byte_tokenizer, make_tiny_model

from nanopaged import LLM, SamplingParams
from nanopaged.engine.model_runner import kv_bytes_per_block

GREEDY8 = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    add_byte_tokenizer(path)
    return path


def _block_bytes(llm: LLM) -> int:
    return llm.runner.kv_bytes_per_block


def test_swap_resumes_a_group_that_needs_the_whole_pool(llama):
    """Swap-in used to reserve a copy-on-write block per sequence even with nothing shared, so
    a group needing every block never came back: "the scheduler could not make progress"."""
    probe = LLM(str(llama), block_size=8, max_model_len=32, kv_cache_memory=1 << 20)
    memory = 4 * _block_bytes(probe)
    prompts = [[1], list(range(2, 26))]
    outs = {}
    for mode in ("swap", "recompute"):
        llm = LLM(str(llama), block_size=8, max_model_len=32, kv_cache_memory=memory,
                  preemption_mode=mode)  # fmt: skip
        assert llm.block_manager.num_blocks == 4
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY8, False)]
        assert llm.scheduler.num_preemptions > 0
        assert llm.block_manager.num_free_blocks == 4
    assert outs["swap"] == outs["recompute"] == [
        o.outputs[0].token_ids for o in probe.generate(prompts, GREEDY8, False)
    ]


def test_swapped_group_falls_back_to_recompute_when_it_cannot_come_back(llama):
    """With nothing running, a swapped-out group that does not fit the free pool is recomputed
    instead of stalling the engine."""
    from nanopaged.engine.sequence import Sequence, SequenceGroup, SequenceStatus

    llm = LLM(str(llama), block_size=8, max_model_len=32, kv_cache_memory=1 << 20,
              preemption_mode="swap")  # fmt: skip
    sched, bm = llm.scheduler, llm.block_manager
    seq = Sequence(list(range(20)), GREEDY8)
    group = SequenceGroup("g", seq)
    sched.add(group)
    batch = sched.schedule()
    assert batch.seqs == [seq]
    sched.advance(batch)
    sched.commit(batch, [7])
    sched.running.remove(group)
    sched._preempt(group, batch)  # swapped out
    assert seq.status == SequenceStatus.SWAPPED
    hog = bm.num_free_blocks - 1  # leave less than the group needs, and nothing running
    taken = [bm._take_free_block() for _ in range(hog)]
    sched.schedule()
    assert seq.status == SequenceStatus.WAITING and not sched.swapped  # to be recomputed
    assert seq.num_preemptions == 1 and seq.num_computed_tokens == 0 and not seq.block_table
    assert bm.cpu_pool.num_free_blocks == bm.cpu_pool.num_blocks
    for b in taken:
        bm._decref(b)
    batch = sched.schedule()
    assert batch.seqs == [seq]
    assert seq.num_computed_tokens + batch.num_scheduled_tokens[0] == len(seq)


def test_no_assert_carries_a_side_effect(llama, tmp_path):
    """Under `python -O` asserts vanish: n > 1 groups and swap-ins used to get no blocks."""
    script = tmp_path / "run.py"
    script.write_text(
        f"""
from nanopaged import LLM, SamplingParams
prompts = [[i % 500 + 1 for i in range(k, k + 20)] for k in range(6)]
p = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
outs = {{}}
for memory, mode in ((1 << 22, "recompute"), (96 << 10, "swap"), (96 << 10, "recompute")):
    llm = LLM({str(llama)!r}, block_size=8, max_model_len=64, kv_cache_memory=memory,
              preemption_mode=mode)
    outs[(memory, mode)] = [[c.token_ids for c in o.outputs] for o in llm.generate(
        prompts, p, use_tqdm=False)]
    if memory < 1 << 20:
        assert llm.scheduler.num_preemptions > 0, "no preemption"
values = list(outs.values())
print("SAME" if values[0] == values[1] == values[2] else "DIFFERENT")
"""
    )
    assert _block_bytes(LLM(str(llama), block_size=8, max_model_len=64)) * 12 <= 96 << 10
    run = subprocess.run([sys.executable, "-O", str(script)], capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().endswith("SAME")


def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize(
    "file, eos",
    [
        ("config.json", 512),
        ("config.json", -1),
        ("config.json", [1, 9999]),
        ("config.json", "2"),
        ("generation_config.json", 600),
        ("generation_config.json", [True]),
    ],
)
def test_eos_ids_outside_the_vocabulary_are_refused(llama, tmp_path, file, eos):
    """EOS ids index the logits (min_tokens masking): one outside the vocabulary used to crash
    the first request (a device-side assert on CUDA, losing the LLM)."""
    path = _copy_model(llama, tmp_path / "m")
    target = path / file
    cfg = json.loads(target.read_text()) if target.exists() else {}
    cfg["eos_token_id"] = eos
    target.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"eos_token_id.*{file}"):
        LLM(str(path))


def test_malformed_generation_config_is_reported_like_config_json(llama, tmp_path):
    path = _copy_model(llama, tmp_path / "m")
    (path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        LLM(str(path))
    (path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="generation_config.json must hold a JSON object"):
        LLM(str(path))


def test_tokenizer_eos_outside_the_vocabulary_is_refused(tmp_path):
    path = make_tiny_model(tmp_path / "m", "llama", vocab_size=200)
    add_byte_tokenizer(path, vocab_size=512)  # its <eos> (256) is past the model's 200 ids
    with pytest.raises(ValueError, match="tokenizer's eos_token_id 256 is outside"):
        LLM(str(path))


def test_min_tokens_with_valid_eos_ids_still_masks(llama):
    llm = LLM(str(llama), kv_cache_memory=1 << 22)
    assert llm.eos_token_ids and all(0 <= t < 512 for t in llm.eos_token_ids)
    p = SamplingParams(temperature=0, max_tokens=6, min_tokens=6, stop_token_ids=[3])
    out = llm.generate([[1, 2, 3]], p, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and not set(out.token_ids) & (llm.eos_token_ids | {3})


def test_a_kv_budget_the_config_decides_is_checked_before_loading(llama, monkeypatch):
    import nanopaged.engine.model_runner as mr

    def no_load(*args, **kwargs):
        raise AssertionError("weights were loaded before the KV budget was checked")

    monkeypatch.setattr(mr, "load_weights", no_load)
    with pytest.raises(ValueError, match="raise kv_cache_memory, or lower") as e:
        LLM(str(llama), kv_cache_memory=1, device="cpu")
    assert "gpu_memory_utilization" not in str(e.value)
    with pytest.raises(ValueError, match="swap_space"):
        LLM(str(llama), kv_cache_memory=1 << 22, preemption_mode="swap", swap_space=1e-9)


def test_kv_bytes_per_block_matches_the_runner(llama):
    llm = LLM(str(llama), block_size=16, kv_cache_memory=1 << 22)
    assert kv_bytes_per_block(llm.model_config, 16, llm.dtype) == _block_bytes(llm)
    assert llm.runner.kv_cache[:, :, 0].numel() * 4 == _block_bytes(llm)


def test_slot_utilization_of_an_empty_pool_is_zero(llama):
    llm = LLM(str(llama), kv_cache_memory=1 << 22)
    assert llm.kv_stats().num_used_blocks == 0
    assert llm.kv_stats().slot_utilization == 0.0


def test_progress_rates_count_each_kind_over_its_own_steps(llama, monkeypatch):
    """The bar's prefill rate used to divide by the whole run, and a 1-token prompt counted as
    decode."""
    import nanopaged.engine.llm_engine as engine_module

    seen = []
    real = engine_module.StepRates.add

    def spy(self, num_prefill, num_decode):
        seen.append((num_prefill, num_decode))
        real(self, num_prefill, num_decode)

    monkeypatch.setattr(engine_module.StepRates, "add", spy)
    llm = LLM(str(llama), kv_cache_memory=1 << 22)
    llm.generate([[5]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), False)
    assert seen == [(1, 0), (0, 1), (0, 1)]
    rates = engine_module.StepRates()
    rates.seconds = {"prefill": 0.5, "decode": 2.0}
    rates.tokens = {"prefill": 1000, "decode": 100}
    assert rates.describe() == "prefill 2000 tok/s, decode 50 tok/s"
