"""SpeculativeConfig parsed from vLLM's speculative_config dicts, and its errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanopaged.spec import SpeculativeConfig
from nanopaged.spec.config import DEFAULT_DISABLE_BY_BATCH_SIZE, speculative_config


def test_ngram_dict_and_vllm_defaults():
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4,
                                       "prompt_lookup_max": 5, "prompt_lookup_min": 2})
    assert (cfg.method, cfg.num_speculative_tokens) == ("ngram", 4)
    assert (cfg.prompt_lookup_max, cfg.prompt_lookup_min, cfg.model) == (5, 2, None)
    assert cfg.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE
    # A missing bound takes the other's value; both missing take 5.
    one = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                       "prompt_lookup_max": 4})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (4, 4)
    one = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                       "prompt_lookup_min": 2})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (2, 2)
    none = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                        "disable_by_batch_size": None})
    assert (none.prompt_lookup_min, none.prompt_lookup_max) == (5, 5)
    assert none.disable_by_batch_size is None


def test_draft_model_dict(tmp_path):
    cfg = SpeculativeConfig.from_dict({"method": "draft_model", "model": "/m/draft",
                                       "num_speculative_tokens": 5, "disable_by_batch_size": 8})
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("draft_model", "/m/draft", 5)
    assert cfg.disable_by_batch_size == 8
    assert cfg.prompt_lookup_max is None
    # vLLM: a model without a method is a draft model; paths may be Path objects.
    cfg = SpeculativeConfig.from_dict({"model": Path(tmp_path), "num_speculative_tokens": 2})
    assert (cfg.method, cfg.model) == ("draft_model", str(tmp_path))
    assert speculative_config(cfg) is cfg
    assert speculative_config(None) is None
    assert speculative_config({"model": "d", "num_speculative_tokens": 1}).model == "d"


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp", "medusa", "suffix", None])
def test_other_methods_are_refused(method):
    with pytest.raises(ValueError, match=r"method must be one of 'ngram', 'draft_model'"):
        SpeculativeConfig.from_dict({"method": method, "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="method must be one of"):
        SpeculativeConfig(method=method, num_speculative_tokens=3, model="d")


@pytest.mark.parametrize(
    ("config", "error", "message"),
    [
        ({"method": "ngram"}, ValueError, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, ValueError,
         "num_speculative_tokens must be >= 1, got 0"),
        ({"method": "ngram", "num_speculative_tokens": 2.0}, TypeError,
         "num_speculative_tokens must be an int"),
        ({"method": "ngram", "num_speculative_tokens": True}, TypeError,
         "num_speculative_tokens must be an int"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0,
          "prompt_lookup_min": 0}, ValueError, "prompt_lookup_max must be >= 1, got 0"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
          "prompt_lookup_min": 0}, ValueError, "prompt_lookup_min must be >= 1, got 0"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
          "prompt_lookup_min": 3}, ValueError,
         r"prompt_lookup_min must be <= prompt_lookup_max \(2\), got 3"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": "4"}, TypeError,
         "prompt_lookup_max must be an int"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
         ValueError, "disable_by_batch_size must be >= 1, got 0"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, ValueError,
         "takes method, num_speculative_tokens, .*; got unknown model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "acceptance": "x"}, ValueError,
         "got unknown acceptance"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, ValueError,
         "method 'draft_model' needs model"),
        ({"method": "draft_model", "num_speculative_tokens": 2, "model": ""}, ValueError,
         "method 'draft_model' needs model"),
        ({"method": "draft_model", "model": "d", "num_speculative_tokens": 2,
          "prompt_lookup_max": 3}, ValueError, "got unknown prompt_lookup_max"),
    ],
)
def test_bad_fields_are_named(config, error, message):
    with pytest.raises(error, match=message):
        SpeculativeConfig.from_dict(config)


def test_direct_construction_checks_too():
    with pytest.raises(ValueError, match="prompt_lookup_max applies to method 'ngram' only"):
        SpeculativeConfig("draft_model", 2, prompt_lookup_max=3, model="d")
    with pytest.raises(ValueError, match="model applies to method 'draft_model' only"):
        SpeculativeConfig("ngram", 2, 3, 1, model="d")
    with pytest.raises(ValueError, match="needs prompt_lookup_max and prompt_lookup_min"):
        SpeculativeConfig("ngram", 2)
    with pytest.raises(TypeError, match="speculative_config must be a dict"):
        SpeculativeConfig.from_dict(["ngram"])
