"""Scripts in the style of vLLM's offline examples run unchanged but for their import line.

Each SCRIPT below is written against vLLM (`from vllm import ...`); the test swaps the import
for nanopaged's, runs it on a tiny fp32 Llama (byte tokenizer, a chat template) and checks what
it computed: prompt logprobs against HF's log_softmax, logit controls against their promise.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tiny_models import add_byte_tokenizer, add_chat_template, make_tiny_model

MAX_MODEL_LEN = 256
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
    "{% if not (continue_final_message and loop.last) %}</>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_tiny_model(path, "llama", max_position_embeddings=MAX_MODEL_LEN)
    add_byte_tokenizer(path)
    add_chat_template(path, CHAT_TEMPLATE)
    return path


def run_vllm_script(script: str, model_dir) -> dict:
    """Run a vLLM-style script with only `vllm` in its import lines changed; its globals."""
    lines = script.strip().splitlines()
    ported = [
        line.replace("from vllm", "from nanopaged", 1) if line.startswith("from vllm") else line
        for line in lines
    ]
    assert sum(a != b for a, b in zip(lines, ported)) <= 2  # the import lines, nothing else
    namespace = {"MODEL": str(model_dir)}
    exec(compile("\n".join(ported), "<vllm-script>", "exec"), namespace)
    return namespace


BASIC = """
from vllm import LLM, SamplingParams

prompts = ["Hello, my name is", "The president of the United States is",
           "The capital of France is", "The future of AI is"]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
llm = LLM(model=MODEL)
outputs = llm.generate(prompts, sampling_params)
texts = []
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    texts.append((prompt, generated_text))
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")

# Dict prompts, max_tokens=None, the tokenizer
tokenizer = llm.get_tokenizer()
ids = tokenizer.encode("The capital of France is")
greedy = SamplingParams(temperature=0, max_tokens=8)
by_text = llm.generate({"prompt": "The capital of France is"}, greedy)
by_ids = llm.generate([{"prompt_token_ids": ids}], greedy)
unbounded = llm.generate(ids, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
kept = llm.generate("The capital of France is",
                    SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=5))
defaults = llm.get_default_sampling_params()
"""


def test_basic_generation_and_prompt_forms(model_dir):
    ns = run_vllm_script(BASIC, model_dir)
    assert [p for p, _ in ns["texts"]] == ns["prompts"]
    assert all(isinstance(t, str) and t for _, t in ns["texts"])
    # vLLM's default max_tokens (16): every sample that did not draw an EOS runs to it.
    lengths = [(len(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in ns["outputs"]]
    assert all(n == 16 if why == "length" else n < 16 and why == "stop" for n, why in lengths)
    assert any(why == "length" for _, why in lengths), lengths
    by_text, by_ids = ns["by_text"][0], ns["by_ids"][0]
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids == ns["ids"]
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_ids.prompt is None
    (unbounded,) = ns["unbounded"]
    assert len(unbounded.outputs[0].token_ids) == MAX_MODEL_LEN - len(ns["ids"])
    assert unbounded.outputs[0].finish_reason == "length"
    assert ns["kept"][0].prompt_token_ids == ns["ids"][-5:]
    assert ns["defaults"].temperature == 1.0  # the tiny model's generation_config sets none


CHAT = """
from vllm import LLM, SamplingParams

llm = LLM(model=MODEL)
sampling_params = SamplingParams(temperature=0, max_tokens=6)
conversation = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hello! How can I assist you today?"},
    {"role": "user", "content": "Write an essay about the importance of higher education."},
]
outputs = llm.chat(conversation, sampling_params, use_tqdm=False)

conversations = [conversation for _ in range(3)]
batch = llm.chat(conversations, sampling_params, use_tqdm=False)

chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\\n{% endfor %}"
custom = llm.chat(conversation, sampling_params, use_tqdm=False, chat_template=chat_template)

partial = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi, I am"}]
continued = llm.chat(partial, sampling_params, use_tqdm=False, add_generation_prompt=False,
                     continue_final_message=True)
parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
                 sampling_params, use_tqdm=False)
"""


def test_chat(model_dir):
    ns = run_vllm_script(CHAT, model_dir)
    (one,) = ns["outputs"]
    assert one.prompt.endswith("<user>Write an essay about the importance of higher "
                               "education.</><assistant>")  # fmt: skip
    assert [o.outputs[0].token_ids for o in ns["batch"]] == [one.outputs[0].token_ids] * 3
    assert ns["custom"][0].prompt.startswith("[system] You are a helpful assistant\n")
    assert ns["continued"][0].prompt == "<user>Say hi</><assistant>Hi, I am"
    assert ns["parts"][0].prompt == "<user>Hello</><assistant>"


LOGPROBS = """
from vllm import LLM, SamplingParams
from vllm import BeamSearchParams

llm = LLM(model=MODEL, dtype="float32")
params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2)
outputs = llm.generate("The capital of France is", params)
output = outputs[0]
for token_id, logprobs in zip(output.outputs[0].token_ids, output.outputs[0].logprobs):
    chosen = logprobs[token_id]
    print(token_id, chosen.logprob, chosen.rank, chosen.decoded_token)
for entry in output.prompt_logprobs[1:]:
    best = max(entry.values(), key=lambda lp: lp.logprob)

beams = llm.beam_search([{"prompt": "The capital of France is"}],
                        BeamSearchParams(beam_width=2, max_tokens=6))
best_beam = beams[0].sequences[0]
print(best_beam.text, best_beam.cum_logprob)
"""


def test_logprobs_and_prompt_logprobs_equal_hf(model_dir):
    import transformers

    ns = run_vllm_script(LOGPROBS, model_dir)
    out = ns["output"]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [len(ids), vocab]
    n = len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n
    for j in range(1, n):
        entry, row = out.prompt_logprobs[j], lp[j - 1]
        token = out.prompt_token_ids[j]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(2).indices.tolist()
        assert set(top) <= set(entry) and len(entry) <= 3
        assert [entry[t].rank for t in top] == [1, 2]
        assert entry[token].decoded_token == ns["llm"].get_tokenizer().decode([token])
    for t, (token, entry) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        row = lp[n + t - 1]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == 1  # greedy
        assert len(entry) == 3
    best = ns["best_beam"]
    assert best.tokens[:n] == out.prompt_token_ids and len(best.tokens) == n + 6
    assert best.text.startswith("The capital of France is")
    assert sum(d[tok].logprob for d, tok in zip(best.logprobs, best.tokens[n:])) == (
        pytest.approx(best.cum_logprob, abs=1e-4)
    )


LOGIT_CONTROLS = """
from vllm import LLM, SamplingParams

llm = LLM(model=MODEL)
tokenizer = llm.get_tokenizer()
forced_id = tokenizer.encode("Z")[0]
forced = llm.generate("Hello", SamplingParams(max_tokens=6, logit_bias={forced_id: 100}))
letters = tokenizer.encode("abcdefgh")
plain = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=12,
                                             allowed_token_ids=letters))
bad_words = [tokenizer.decode(plain[0].outputs[0].token_ids[2:4])]
banned = llm.generate(["Hello"] * 4,
                      [SamplingParams(temperature=t, seed=i, max_tokens=12, bad_words=bad_words,
                                      allowed_token_ids=letters)
                       for i, t in enumerate([0, 1.0, 1.0, 1.5])])
allowed_token_ids = tokenizer.encode("abc")
allowed = llm.generate(["Hello"] * 3, SamplingParams(temperature=3.0, max_tokens=10,
                                                      allowed_token_ids=allowed_token_ids))
"""


def test_logit_controls(model_dir):
    ns = run_vllm_script(LOGIT_CONTROLS, model_dir)
    assert ns["forced"][0].outputs[0].token_ids == [ns["forced_id"]] * 6
    word = ns["plain"][0].outputs[0].token_ids[2:4]
    assert len(word) == 2
    for o in ns["banned"]:
        ids = o.outputs[0].token_ids
        assert not any(ids[i : i + 2] == word for i in range(len(ids) - 1))
        assert ns["bad_words"][0] not in o.outputs[0].text
    allowed = set(ns["allowed_token_ids"])
    assert all(set(o.outputs[0].token_ids) <= allowed for o in ns["allowed"])
    assert len({t for o in ns["allowed"] for t in o.outputs[0].token_ids}) > 1  # still sampled


def test_generation_config_defaults_and_engine_args(model_dir, tmp_path):
    from nanopaged import LLM, SamplingParams

    copy = tmp_path / "m"
    shutil.copytree(model_dir, copy)
    (copy / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": True})
    )
    llm = LLM(str(copy), kv_cache_memory=1 << 22)
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_p, d.top_k, d.min_p) == (0.6, 0.9, 20, 0.0)
    assert LLM(str(copy), kv_cache_memory=1 << 22, generation_config="vllm")\
        .get_default_sampling_params() == SamplingParams()  # fmt: skip
    (copy / "generation_config.json").write_text("{temperature: ")
    with pytest.raises(ValueError, match=r"generation_config.json is not valid JSON"):
        LLM(str(copy), kv_cache_memory=1 << 22)
    (copy / "generation_config.json").write_text(json.dumps({"top_p": 3}))
    with pytest.raises(ValueError, match=r"generation_config.json: top_p must be in"):
        LLM(str(copy), kv_cache_memory=1 << 22)
    with pytest.raises(ValueError, match=r"trust_remote_code must be False"):
        LLM(str(model_dir), trust_remote_code=True)
    with pytest.raises(ValueError, match=r"quantization='awq' but .* is not a quantized"):
        LLM(str(model_dir), quantization="awq")
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be >= 1"):
        LLM(str(model_dir), tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide"):
        LLM(str(model_dir), tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"continue_final_message=True .* add_generation_prompt"):
        llm.chat([{"role": "assistant", "content": "x"}], continue_final_message=True)


FP8_KV = """
from vllm import LLM, SamplingParams

llm = LLM(model=MODEL, kv_cache_dtype="fp8", calculate_kv_scales=True)
outputs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
"""


def test_fp8_kv_cache_with_calculated_scales(model_dir):
    ns = run_vllm_script(FP8_KV, model_dir)
    runner = ns["llm"].runner
    assert runner.kv_cache.dtype == torch.float8_e4m3fn
    assert (runner.kv_scales != 1.0).all()  # calculated from the first pass
    assert len(ns["outputs"][0].outputs[0].token_ids) == 8


PROFILING = """
import os
from vllm import LLM, SamplingParams
from vllm.distributed import cleanup_dist_env_and_memory

os.environ["VLLM_TORCH_PROFILER_DIR"] = PROFILE_DIR
llm = LLM(model=MODEL, enable_chunked_prefill=True, disable_log_stats=False, task="generate",
          tokenizer_mode="auto", max_model_len=256)
llm.start_profile()
outputs = llm.generate(["The future of AI is"] * 4, SamplingParams(temperature=0.8, seed=1,
                                                                    max_tokens=8))
llm.stop_profile()
texts = [o.outputs[0].text for o in outputs]
del llm
cleanup_dist_env_and_memory()
"""


def test_profiling_and_accepted_engine_arguments(model_dir, tmp_path, monkeypatch):
    from nanopaged import LLM, SamplingParams

    profile_dir = tmp_path / "profile"
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    ns = run_vllm_script(PROFILING.replace("PROFILE_DIR", repr(str(profile_dir))), model_dir)
    assert len(ns["texts"]) == 4
    traces = list(profile_dir.glob("*.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any("aten::" in str(e.get("name", "")) for e in events)  # the forward ran inside
    for kwargs, match in [
        (dict(enable_chunked_prefill=False), "enable_chunked_prefill must be True or None"),
        (dict(task="embed"), "task must be 'auto' or 'generate'"),
        (dict(tokenizer_mode="mistral"), "tokenizer_mode must be 'auto'"),
    ]:
        with pytest.raises(ValueError, match=match):
            LLM(str(model_dir), **kwargs)
    # "slow" asks for the Python tokenizer where the model ships one (this one ships only
    # tokenizer.json, so transformers keeps the fast one): the same text either way.
    llm = LLM(str(model_dir), tokenizer_mode="slow", kv_cache_memory=1 << 20)
    greedy = SamplingParams(temperature=0, max_tokens=6)
    auto = LLM(str(model_dir), kv_cache_memory=1 << 20)
    assert (llm.generate("abc", greedy, use_tqdm=False)[0].outputs[0].text
            == auto.generate("abc", greedy, use_tqdm=False)[0].outputs[0].text)  # fmt: skip
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    with pytest.raises(ValueError, match="start_profile needs a directory"):
        llm.start_profile()
    with pytest.raises(RuntimeError, match="the profiler is not running"):
        llm.stop_profile()
