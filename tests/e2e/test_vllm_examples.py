"""Command-line and engine scripts written the way vLLM's offline examples are (EngineArgs on
an argparse parser, LLM(**vars(args)), LLMEngine's step loop, prefix caching, reproducible
seeds) run with only their vllm imports and the model name changed.

Each SCRIPT is nanopaged's own text against vLLM's API; the test swaps the `vllm` imports for
`nanopaged`, runs it as `__main__` with a command line, and checks what it computed.
"""

from __future__ import annotations

import sys

import pytest
from tiny_models import add_byte_tokenizer, add_chat_template, make_tiny_model

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", max_position_embeddings=512)
    add_byte_tokenizer(path)
    add_chat_template(path, CHAT_TEMPLATE)
    return path


def run_script(script: str, model_dir, argv: list[str], monkeypatch) -> dict:
    """Run a vLLM-style script as __main__ with argv, its vllm imports made nanopaged's and
    its model name made model_dir; returns its globals."""
    lines = script.strip().splitlines()
    ported = [
        line.replace("vllm", "nanopaged") if line.startswith(("from vllm", "import vllm"))
        else line.replace("MODEL_NAME", repr(str(model_dir)))
        for line in lines
    ]  # fmt: skip
    # Only the imports and the model name change, nothing else.
    assert all(a == b or a.startswith(("from vllm", "import vllm")) or "MODEL_NAME" in a
               for a, b in zip(lines, ported))  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["script.py", *argv])
    namespace = {"__name__": "__main__"}
    exec(compile("\n".join(ported), "<vllm-script>", "exec"), namespace)
    return namespace


GENERATE = """
from vllm import LLM, EngineArgs
from vllm.utils import FlexibleArgumentParser


def main(args: dict):
    max_tokens = args.pop("max_tokens")
    temperature = args.pop("temperature")
    llm = LLM(**args)
    sampling_params = llm.get_default_sampling_params()
    if max_tokens is not None:
        sampling_params.max_tokens = max_tokens
    if temperature is not None:
        sampling_params.temperature = temperature
    outputs = llm.generate(["Hello, my name is", "The capital of France is"], sampling_params)
    for output in outputs:
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
    return llm, outputs


if __name__ == "__main__":
    parser = FlexibleArgumentParser()
    engine_group = parser.add_argument_group("Engine arguments")
    EngineArgs.add_cli_args(engine_group)
    engine_group.set_defaults(model=MODEL_NAME)
    sampling_group = parser.add_argument_group("Sampling parameters")
    sampling_group.add_argument("--max-tokens", type=int)
    sampling_group.add_argument("--temperature", type=float)
    args: dict = vars(parser.parse_args())
    llm, outputs = main(args)
"""


def test_generate_cli(model_dir, monkeypatch):
    argv = ["--max-tokens", "7", "--temperature", "0", "--max_model_len", "128",
            "--kv-cache-memory", str(1 << 20), "--seed", "3"]  # fmt: skip
    ns = run_script(GENERATE, model_dir, argv, monkeypatch)
    llm, outputs = ns["llm"], ns["outputs"]
    assert llm.max_model_len == 128 and llm.config.seed == 3
    for o in outputs:  # the command line's max_tokens reached the params
        c = o.outputs[0]
        assert len(c.token_ids) <= 7 and (c.finish_reason == "length") == (len(c.token_ids) == 7)
    from nanopaged import SamplingParams

    again = llm.generate([o.prompt for o in outputs],
                         SamplingParams(temperature=0, max_tokens=7), use_tqdm=False)  # fmt: skip
    assert [o.outputs[0].text for o in again] == [o.outputs[0].text for o in outputs]


CHAT = """
from vllm import LLM, EngineArgs, SamplingParams
from vllm.utils import FlexibleArgumentParser


def main(args):
    sampling_params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    del args.max_tokens, args.temperature
    llm = LLM(**vars(args))
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    one = llm.chat(conversation, sampling_params, use_tqdm=False)
    many = llm.chat([conversation for _ in range(4)], sampling_params, use_tqdm=True)
    return llm, one, many


if __name__ == "__main__":
    parser = FlexibleArgumentParser()
    parser = EngineArgs.add_cli_args(parser)
    parser.set_defaults(model=MODEL_NAME)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    llm, one, many = main(args)
"""


def test_chat_cli(model_dir, monkeypatch):
    ns = run_script(CHAT, model_dir, ["--kv-cache-memory", str(1 << 20)], monkeypatch)
    one, many = ns["one"], ns["many"]
    assert len(many) == 4
    assert {o.outputs[0].text for o in many} == {one[0].outputs[0].text}  # greedy, same prompt
    tok = ns["llm"].get_tokenizer()
    assert one[0].prompt_token_ids[-len(tok.encode("<assistant>")):] == tok.encode("<assistant>")


ENGINE = """
import argparse

from vllm import EngineArgs, LLMEngine, RequestOutput, SamplingParams
from vllm.utils import FlexibleArgumentParser


def create_test_prompts():
    return [
        ("A robot may not injure a human being",
         SamplingParams(temperature=0.0, logprobs=1, prompt_logprobs=1, max_tokens=16)),
        ("To be or not to be,", SamplingParams(temperature=0.8, top_k=5, presence_penalty=0.2)),
        ("What is the meaning of life?",
         SamplingParams(n=2, best_of=5, temperature=0.8, top_p=0.95, frequency_penalty=0.1)),
    ]


def process_requests(engine: LLMEngine, test_prompts) -> list[RequestOutput]:
    request_id = 0
    finished = []
    step_id = 0
    while test_prompts or engine.has_unfinished_requests():
        if test_prompts:
            prompt, sampling_params = test_prompts.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params)
            request_id += 1
        if step_id == 4:
            engine.reset_prefix_cache(reset_running_requests=True)
        request_outputs: list[RequestOutput] = engine.step()
        for request_output in request_outputs:
            if request_output.finished:
                print(request_output)
                finished.append(request_output)
        step_id += 1
    return finished


def initialize_engine(args: argparse.Namespace) -> LLMEngine:
    engine_args = EngineArgs.from_cli_args(args)
    return LLMEngine.from_engine_args(engine_args)


if __name__ == "__main__":
    parser = FlexibleArgumentParser(description="Demo on using the LLMEngine class directly")
    parser = EngineArgs.add_cli_args(parser)
    args = parser.parse_args()
    engine = initialize_engine(args)
    finished = process_requests(engine, create_test_prompts())
"""


def test_llm_engine_step_loop_cli(model_dir, monkeypatch):
    from nanopaged import LLM, SamplingParams

    argv = ["--model", str(model_dir), "--kv-cache-memory", str(1 << 20)]
    ns = run_script(ENGINE, model_dir, argv, monkeypatch)
    finished = {o.request_id: o for o in ns["finished"]}
    assert sorted(finished) == ["0", "1", "2"]
    first = finished["0"]
    assert len(first.outputs[0].token_ids) == 16 and len(first.outputs[0].logprobs) == 16
    assert first.prompt_logprobs[0] is None and len(first.prompt_logprobs) == len(
        first.prompt_token_ids)
    assert len(finished["2"].outputs) == 2  # n=2 of best_of=5
    llm = LLM(str(model_dir), kv_cache_memory=1 << 20)
    want = llm.generate("A robot may not injure a human being",
                        SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)  # fmt: skip
    assert first.outputs[0].token_ids == want[0].outputs[0].token_ids
    engine = ns["engine"]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


PREFIX_CACHING = """
from vllm import LLM, SamplingParams
from vllm.distributed import cleanup_dist_env_and_memory

prefix = ("You are an expert school principal, skilled in effectively managing faculty and "
          "staff. Draft 10-15 questions for a potential first grade Head Teacher. ")
prompts = ["Hello, my name is", "The president of the United States is",
           "The capital of France is", "The future of AI is"]
generating_prompts = [prefix + prompt for prompt in prompts]
sampling_params = SamplingParams(temperature=0.0, max_tokens=10)

regular_llm = LLM(model=MODEL_NAME, enable_prefix_caching=False, kv_cache_memory=1 << 20)
regular_outputs = regular_llm.generate(generating_prompts, sampling_params)
regular_texts = [o.outputs[0].text for o in regular_outputs]
del regular_llm
cleanup_dist_env_and_memory()

prefix_cached_llm = LLM(model=MODEL_NAME, enable_prefix_caching=True, kv_cache_memory=1 << 20)
prefix_cached_llm.generate(generating_prompts[0], sampling_params)  # warm the cache
outputs = prefix_cached_llm.generate(generating_prompts, sampling_params)
cached_texts = [o.outputs[0].text for o in outputs]
generated_same = all(a == b for a, b in zip(regular_texts, cached_texts))
num_cached = [o.num_cached_tokens for o in outputs]
"""


def test_prefix_caching(model_dir, monkeypatch):
    ns = run_script(PREFIX_CACHING, model_dir, [], monkeypatch)
    assert ns["generated_same"] and len(ns["cached_texts"]) == 4
    assert min(ns["num_cached"]) >= 16  # every prompt found the shared prefix's blocks


REPRODUCIBILITY = """
import random

from vllm import LLM, SamplingParams

SEED = 42
random.seed(SEED)
prompts = ["Hello, my name is", "The president of the United States is",
           "The capital of France is", "The future of AI is"]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12)


def run():
    llm = LLM(model=MODEL_NAME, seed=SEED, kv_cache_memory=1 << 20)
    return [o.outputs[0].text for o in llm.generate(prompts, sampling_params)]


first, second = run(), run()
"""


def test_reproducibility(model_dir, monkeypatch):
    ns = run_script(REPRODUCIBILITY, model_dir, [], monkeypatch)
    assert ns["first"] == ns["second"] and len(set(ns["first"])) > 1
