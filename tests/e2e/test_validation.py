"""Bad input raises ValueError/TypeError naming the field, before any request starts.

Each case is checked three ways: the error type and message (the field and what is allowed),
an engine left empty (no request queued, every block free), and unchanged results: after the
refused call the LLM answers a probe batch exactly like a twin LLM that never saw it, unseeded
random samples included (so the refused call did not even draw a random number).
"""

from __future__ import annotations

import json
import math

import pytest
from tiny_models import add_byte_tokenizer, add_chat_template, make_tiny_model

from nanopaged import LLM, BeamSearchParams, SamplingParams

MAX_MODEL_LEN = 128
KV = 1 << 20  # 128 blocks of 16 tokens
GOOD = [[3, 1, 4, 1, 5], "hello"]  # the two valid prompts before the bad third one
EOS = 256  # the byte tokenizer's <eos> (tiny_models.add_byte_tokenizer: after the 256 bytes)
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", max_position_embeddings=256)
    add_byte_tokenizer(path)
    add_chat_template(path, CHAT_TEMPLATE)
    return path


def _llm(model_dir) -> LLM:
    return LLM(str(model_dir), kv_cache_memory=KV, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def llm(model_dir):
    return _llm(model_dir)


@pytest.fixture(scope="module")
def twin(model_dir):
    return _llm(model_dir)


def _probe(llm: LLM):
    """A batch touching every sampling path; returns what must not change."""
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7, max_tokens=6),
        SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True),  # unseeded
        SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=4, logprobs=2),
        SamplingParams(temperature=0, max_tokens=12, stop=["q"], ignore_eos=True),
    ]
    outs = llm.generate([[3, 1, 4, 1, 5], "abc", [9] * 20, [2, 7], "hello"], params,
                        use_tqdm=False)  # fmt: skip
    return [
        [(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in o.outputs] for o in outs
    ]


def _assert_untouched(llm: LLM, twin: LLM) -> None:
    assert not llm.scheduler.has_unfinished()
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not any(bm.ref_counts)
    assert _probe(llm) == _probe(twin)


def _refused(llm, twin, error, match, call) -> None:
    with pytest.raises(error, match=match):
        call()
    _assert_untouched(llm, twin)


# ---- SamplingParams ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(temperature=-0.1), ValueError, r"temperature must be a finite number >= 0"),
        (dict(temperature=math.nan), ValueError, r"temperature .* got nan"),
        (dict(temperature=math.inf), ValueError, r"temperature .* got inf"),
        (dict(temperature="1"), TypeError, r"temperature must be a number, got str"),
        (dict(top_p=0), ValueError, r"top_p must be in \(0, 1\], got 0"),
        (dict(top_p=1.01), ValueError, r"top_p must be in \(0, 1\]"),
        (dict(top_p=math.nan), ValueError, r"top_p must be in \(0, 1\]"),
        (dict(top_k=-2), ValueError, r"top_k must be -1 \(disabled\) or >= 1, got -2"),
        (dict(top_k=0), ValueError, r"top_k must be -1"),
        (dict(top_k=2.0), TypeError, r"top_k must be an int, got float"),
        (dict(top_k=True), TypeError, r"top_k must be an int, got bool"),
        (dict(min_p=-0.01), ValueError, r"min_p must be in \[0, 1\]"),
        (dict(min_p=1.5), ValueError, r"min_p must be in \[0, 1\]"),
        (dict(max_tokens=0), ValueError, r"max_tokens must be None or >= 1, got 0"),
        (dict(max_tokens="8"), TypeError, r"max_tokens must be an int, got str"),
        (dict(max_tokens=8.0), TypeError, r"max_tokens must be an int"),
        (dict(n=0), ValueError, r"n must be >= 1, got 0"),
        (dict(n=True), TypeError, r"n must be an int, got bool"),
        (dict(min_tokens=-1), ValueError, r"min_tokens must be >= 0"),
        (dict(min_tokens=5, max_tokens=4), ValueError, r"min_tokens must be <= max_tokens"),
        (dict(seed=-1), ValueError, r"seed must be in \[0, 2\*\*64\), got -1"),
        (dict(seed=2**64), ValueError, r"seed must be in \[0, 2\*\*64\)"),
        (dict(seed=1.5), TypeError, r"seed must be an int, got float"),
        (dict(stop=5), TypeError, r"stop must be a str or a list of str, got int"),
        (dict(stop=[""]), ValueError, r"stop must be a non-empty string"),
        (dict(stop=["ok", "\ud800"]), ValueError, r"stop is not valid Unicode"),
        (dict(bad_words=["x\udfff"]), ValueError, r"bad_words is not valid Unicode"),
        (dict(stop=["a", 3]), ValueError, r"stop must be a non-empty string .* got 3"),
        (dict(stop_token_ids=5), TypeError, r"stop_token_ids must be a list of int token ids"),
        (dict(stop_token_ids=[-1]), ValueError, r"stop_token_ids must hold ints >= 0"),
        (dict(stop_token_ids=[True]), ValueError, r"stop_token_ids must hold ints >= 0"),
        (dict(ignore_eos="no"), TypeError, r"ignore_eos must be a bool, got str"),
        (dict(skip_special_tokens=1), TypeError, r"skip_special_tokens must be a bool"),
        (dict(include_stop_str_in_output=None), TypeError, r"include_stop_str_in_output"),
        (dict(logprobs=-1), ValueError, r"logprobs must be None or >= 0"),
        (dict(logprobs=1.0), TypeError, r"logprobs must be an int"),
        (dict(presence_penalty=2.5), ValueError, r"presence_penalty must be in \[-2, 2\]"),
        (dict(repetition_penalty=0), ValueError, r"repetition_penalty must be a finite"),
        (dict(prompt_logprobs=-1), ValueError, r"prompt_logprobs must be None or >= 0"),
        (dict(logit_bias=[1]), TypeError, r"logit_bias must be a dict of token id -> bias"),
        (dict(logit_bias={"a": 1.0}), ValueError, r"logit_bias keys must be int token ids"),
        (dict(logit_bias={1: math.inf}), ValueError, r"logit_bias\[1\] must be finite"),
        (dict(bad_words="no"), TypeError, r"bad_words must be a list of str, got str"),
        (dict(bad_words=[" "]), ValueError, r"bad_words must hold non-blank strings"),
        (dict(allowed_token_ids=[]), ValueError, r"allowed_token_ids must not be empty"),
        (dict(allowed_token_ids=[-3]), ValueError, r"allowed_token_ids must hold ints >= 0"),
        (dict(truncate_prompt_tokens=0), ValueError, r"truncate_prompt_tokens must be None, -1"),
    ],
)
def test_sampling_params_refuse_bad_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_refuse_unknown_fields():
    with pytest.raises(TypeError, match="temprature"):
        SamplingParams(temprature=0.5)


def test_tiny_temperature_is_greedy(llm):
    # Dividing logits by a denormal temperature overflows to inf and NaN; it means greedy.
    p = SamplingParams(temperature=1e-40, max_tokens=8, ignore_eos=True)
    assert p.temperature == 0 and p.greedy
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([[5, 6, 7], [5, 6, 7]], [p, greedy], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids


# ---- generate: the bad item is the third, after two valid ones ----------------------------
def _mutated(**changes) -> SamplingParams:
    p = SamplingParams(max_tokens=4)
    for k, v in changes.items():
        setattr(p, k, v)  # after construction: only generate's own check can catch it
    return p


BAD_PROMPTS = [
    ([], ValueError, r"prompts\[2\] is empty"),
    ("", ValueError, r"prompts\[2\] is empty"),
    ([1, 2, 512], ValueError, r"prompts\[2\] holds token id 512, outside the vocabulary \[0,"),
    ([1, -1], ValueError, r"prompts\[2\] holds token id -1"),
    ([1] * (MAX_MODEL_LEN + 1), ValueError, r"prompts\[2\] has 129 tokens, more than max_model"),
    ("x" * (MAX_MODEL_LEN + 1), ValueError, r"prompts\[2\] has 129 tokens"),
    (1.5, TypeError, r"prompts\[2\] must be a str or a list of int token ids, .*got float"),
    (None, TypeError, r"prompts\[2\] must be a str or a list of int"),
    ([1, True], TypeError, r"prompts\[2\] must be a str or a list of int"),
    ([1, 2.0], TypeError, r"prompts\[2\] must be a str or a list of int"),
    ([[1, 2]], TypeError, r"prompts\[2\] must be a str or a list of int"),
    ({"a": 1}, TypeError, r"prompts\[2\] must be a str or a list of int"),
    ({"prompt": "x", "multi_modal_data": {}}, TypeError, r"no other prompt keys"),
    ({"prompt_token_ids": [1, 2.5]}, TypeError, r"prompts\[2\] must be a str or a list"),
    (b"hello", TypeError, r"prompts\[2\] is bytes: pass text \(decode it first\)"),
    (bytearray(b"hi"), TypeError, r"prompts\[2\] is bytearray"),
    ("caf\udce9", ValueError, r"prompts\[2\] is not valid Unicode: .* at index 3"),
    ({"prompt": "\ud83d!"}, ValueError, r"prompts\[2\] is not valid Unicode"),
]  # fmt: skip


@pytest.mark.parametrize("bad, error, match", BAD_PROMPTS)
def test_bad_prompt(llm, twin, bad, error, match):
    _refused(llm, twin, error, match, lambda: llm.generate(GOOD + [bad], use_tqdm=False))


BAD_PARAMS = [
    ([SamplingParams()] * 2, ValueError, r"sampling_params has 2 entries but there are 3 prompts"),
    ([SamplingParams()] * 4, ValueError, r"sampling_params has 4 entries"),
    ([SamplingParams(), SamplingParams(), None], TypeError,
     r"sampling_params\[2\] must be a SamplingParams, got NoneType"),
    ([SamplingParams(), SamplingParams(), {"temperature": 0}], TypeError,
     r"sampling_params\[2\] must be a SamplingParams, got dict"),
    ({"temperature": 0}, TypeError, r"sampling_params must be a SamplingParams or a list"),
    (0.5, TypeError, r"sampling_params must be a SamplingParams or a list"),
    ([SamplingParams(), SamplingParams(), _mutated(top_p=2.0)], ValueError,
     r"sampling_params\[2\]: top_p must be in \(0, 1\]"),
    ([SamplingParams(), SamplingParams(), _mutated(stop_token_ids=7)], TypeError,
     r"sampling_params\[2\]: stop_token_ids must be a list"),
    ([SamplingParams(), SamplingParams(), _mutated(max_tokens=0)], ValueError,
     r"sampling_params\[2\]: max_tokens must be None or >= 1"),
    ([SamplingParams(), SamplingParams(), SamplingParams(logit_bias={512: 1.0})], ValueError,
     r"sampling_params\[2\].logit_bias holds 512, outside the vocabulary"),
    ([SamplingParams(), SamplingParams(), SamplingParams(allowed_token_ids=[1, 600])], ValueError,
     r"sampling_params\[2\].allowed_token_ids holds 600, outside the vocabulary"),
    ([SamplingParams(), SamplingParams(), SamplingParams(stop_token_ids=[3, 512], min_tokens=1)],
     ValueError, r"sampling_params\[2\].stop_token_ids holds 512, outside the vocabulary"),
    ([SamplingParams(), SamplingParams(), SamplingParams(logprobs=21)], ValueError,
     r"sampling_params\[2\].logprobs=21 is more than max_logprobs=20"),
    ([SamplingParams(), SamplingParams(), SamplingParams(prompt_logprobs=10**6)], ValueError,
     r"sampling_params\[2\].prompt_logprobs=1000000 is more than max_logprobs=20"),
    ([SamplingParams(), SamplingParams(), SamplingParams(allowed_token_ids=[EOS], min_tokens=3)],
     ValueError, r"sampling_params\[2\].allowed_token_ids holds only stop tokens .* "
     r"min_tokens=3 forbids"),
    ([SamplingParams(), SamplingParams(),
      SamplingParams(allowed_token_ids=[EOS, 7], stop_token_ids=[7], min_tokens=1)],
     ValueError, r"allowed_token_ids holds only stop tokens"),
    ([SamplingParams(), SamplingParams(), SamplingParams(n=300)], ValueError,
     r"prompts\[2\]: sampling_params n=300 exceeds max_num_seqs=256"),
    ([SamplingParams(), SamplingParams(), SamplingParams(n=200, max_tokens=100)], ValueError,
     r"prompts\[2\]: .* KV blocks, more than the cache's 128; raise kv_cache_memory"),
]  # fmt: skip


@pytest.mark.parametrize("params, error, match", BAD_PARAMS)
def test_bad_sampling_params(llm, twin, params, error, match):
    prompts = GOOD + [[2, 3]]
    _refused(llm, twin, error, match, lambda: llm.generate(prompts, params, use_tqdm=False))


def test_max_logprobs_sets_the_cap(model_dir):
    # A raised cap lets more through and refuses past it; -1 lifts it (up to the vocabulary).
    llm = LLM(str(model_dir), kv_cache_memory=KV, max_model_len=MAX_MODEL_LEN, max_logprobs=30)
    p = SamplingParams(max_tokens=2, logprobs=25, prompt_logprobs=25)
    out = llm.generate([[3, 1, 4]], p, use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) >= 25 and len(out.prompt_logprobs[1]) >= 25
    with pytest.raises(ValueError, match=r"logprobs=31 is more than max_logprobs=30"):
        llm.generate([[3]], SamplingParams(logprobs=31), use_tqdm=False)
    llm = LLM(str(model_dir), kv_cache_memory=KV, max_model_len=MAX_MODEL_LEN, max_logprobs=-1)
    vocab = llm.model_config.vocab_size
    out = llm.generate([[3, 1]], SamplingParams(max_tokens=1, logprobs=10**6), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) == vocab


def test_stop_strings_need_a_tokenizer(tmp_path):
    llm = LLM(str(make_tiny_model(tmp_path / "m", "qwen2")), kv_cache_memory=KV)
    p = SamplingParams(stop=["a"], max_tokens=4)
    with pytest.raises(ValueError, match=r"sampling_params.stop needs a tokenizer"):
        llm.generate([[1, 2, 3]], p, use_tqdm=False)
    assert not llm.scheduler.has_unfinished()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_generate_refuses_unknown_keywords(llm, twin):
    _refused(llm, twin, TypeError, "temperature",
             lambda: llm.generate(GOOD, temperature=0))  # fmt: skip


# ---- chat and beam search ------------------------------------------------------------------
USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    "messages, error, match",
    [
        ("hello", TypeError, r"messages must be a non-empty list"),
        ([], TypeError, r"messages must be a non-empty list"),
        ([[USER], [USER], [{"role": "user"}]], TypeError, r"conversation 2 must be"),
        ([[USER], [USER], [{"role": "user", "content": None}]], TypeError, r"conversation 2"),
        ([[USER], [USER], [{"role": 1, "content": "x"}]], TypeError, r"conversation 2"),
        ([[USER], [USER], []], TypeError, r"conversation 2 must be a non-empty list"),
        ([[USER], [USER], "hi"], TypeError, r"conversation 2"),
        ([[USER], [USER], [{"role": "user", "content": "y" * 200}]], ValueError,
         r"prompts\[2\] has \d+ tokens, more than max_model_len=128"),
    ],
)  # fmt: skip
def test_bad_chat_messages(llm, twin, messages, error, match):
    assert llm.chat([USER], SamplingParams(max_tokens=2), use_tqdm=False)  # the template works
    twin.chat([USER], SamplingParams(max_tokens=2), use_tqdm=False)  # keep the twins in step
    _refused(llm, twin, error, match, lambda: llm.chat(messages, use_tqdm=False))


@pytest.mark.parametrize(
    "params, error, match",
    [
        (SamplingParams(), TypeError, r"params must be a BeamSearchParams, got SamplingParams"),
        ({"beam_width": 2}, TypeError, r"params must be a BeamSearchParams, got dict"),
    ],
)
def test_bad_beam_search(llm, twin, params, error, match):
    _refused(llm, twin, error, match, lambda: llm.beam_search(GOOD, params, use_tqdm=False))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(beam_width=0, max_tokens=4), ValueError, r"beam_width must be >= 1"),
        (dict(beam_width=2, max_tokens=0), ValueError, r"max_tokens must be >= 1"),
        (dict(beam_width=2.0, max_tokens=4), TypeError, r"beam_width must be an int"),
        (dict(beam_width=2, max_tokens=4, length_penalty=math.nan), ValueError, "length_penalty"),
    ],
)
def test_bad_beam_search_params(kwargs, error, match):
    with pytest.raises(error, match=match):
        BeamSearchParams(**kwargs)


# ---- LLM construction ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(block_size=12), ValueError, r"block_size must be a power of two >= 8, got 12"),
        (dict(block_size=4), ValueError, r"block_size must be a power of two >= 8, got 4"),
        (dict(block_size=0), ValueError, r"block_size must be >= 1, got 0"),
        (dict(block_size="16"), TypeError, r"block_size must be an int, got str"),
        (dict(block_size=True), TypeError, r"block_size must be an int, got bool"),
        (dict(kv_cache_memory=15 * 8192), ValueError,
         r"KV cache holds 240 tokens .* less than one sequence of max_model_len=256; raise "
         r"kv_cache_memory, or lower max_model_len"),
        (dict(kv_cache_memory=0), ValueError, r"kv_cache_memory must be >= 1"),
        (dict(kv_cache_memory=1e6), TypeError, r"kv_cache_memory must be an int"),
        (dict(max_model_len=257), ValueError,
         r"max_model_len must be <= the model's max_position_embeddings \(256\), got 257"),
        (dict(max_model_len=0), ValueError, r"max_model_len must be >= 1"),
        (dict(max_model_len=64.0), TypeError, r"max_model_len must be an int"),
        (dict(max_num_seqs=0), ValueError, r"max_num_seqs must be >= 1"),
        (dict(max_num_batched_tokens=-8), ValueError, r"max_num_batched_tokens must be >= 1"),
        (dict(dtype="float64"), ValueError, r"dtype must be 'auto' or one of"),
        (dict(dtype="fp8"), ValueError, r"dtype must be 'auto' or one of"),
        (dict(dtype=16), TypeError, r"dtype must be a str or torch.dtype"),
        (dict(device="tpu"), ValueError, r"device must be 'auto', 'cpu' or 'cuda\[:N\]'"),
        (dict(device="gpu"), ValueError, r"device must be 'auto', 'cpu' or 'cuda\[:N\]'"),
        (dict(device="cuda:99"), ValueError, r"cuda"),
        (dict(gpu_memory_utilization=0), ValueError, r"gpu_memory_utilization must be in"),
        (dict(gpu_memory_utilization=1.5), ValueError, r"gpu_memory_utilization must be in"),
        (dict(gpu_memory_utilization=math.nan), ValueError, r"gpu_memory_utilization"),
        (dict(seed=-1), ValueError, r"seed must be in \[0, 2\*\*64\)"),
        (dict(seed="0"), TypeError, r"seed must be an int"),
        (dict(enable_prefix_caching="no"), TypeError, r"enable_prefix_caching must be a bool"),
        (dict(enforce_eager=1), TypeError, r"enforce_eager must be a bool"),
        (dict(preemption_mode="drop"), ValueError, r"preemption_mode must be one of"),
        (dict(swap_space=-1), ValueError, r"swap_space must be a finite number"),
        (dict(async_scheduling="yes"), TypeError, r"async_scheduling must be"),
        (dict(tokenizer=5), TypeError, r"tokenizer must be a path"),
        (dict(max_num_seq=4), TypeError, r"max_num_seq"),
        (dict(max_logprobs=-2), ValueError, r"max_logprobs must be >= 0, or -1 for no cap"),
        (dict(max_logprobs=2.0), TypeError, r"max_logprobs must be an int"),
    ],
)  # fmt: skip
def test_bad_engine_arguments(model_dir, kwargs, error, match):
    with pytest.raises(error, match=match):
        LLM(str(model_dir), **kwargs)


def test_bad_model_paths(model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        LLM(str(tmp_path / "no-such-model"))
    with pytest.raises(FileNotFoundError, match=r"tokenizer path .*no-such-tokenizer"):
        LLM(str(model_dir), tokenizer=str(tmp_path / "no-such-tokenizer"), kv_cache_memory=KV)
    with pytest.raises(TypeError, match=r"model must be a path \(str or os.PathLike\) or None"):
        LLM(42)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM(str(tmp_path))
    text = tmp_path / "weights.txt"
    text.write_text("not a model")
    with pytest.raises(ValueError, match="neither a directory nor a GGUF file"):
        LLM(str(text))


def _model_copy(model_dir, tmp_path, **config_changes):
    for f in model_dir.iterdir():
        (tmp_path / f.name).symlink_to(f)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(config_changes)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_unsupported_architecture_names_it_and_the_supported_ones(model_dir, tmp_path):
    path = _model_copy(model_dir, tmp_path, architectures=["MambaForCausalLM"])
    with pytest.raises(ValueError, match=r"unsupported architecture \['MambaForCausalLM'\].*"
                       r"supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        LLM(str(path))  # fmt: skip


def test_broken_config_json_names_the_file(model_dir, tmp_path):
    path = _model_copy(model_dir, tmp_path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        LLM(str(path))
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match=r"config.json lacks integer vocab_size, hidden_size"):
        LLM(str(path))
