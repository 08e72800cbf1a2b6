"""CPU: nanopaged against HF transformers on the embedded SmolLM2-135M, same process.

python benchmarks/cpu_bench.py [--rounds N] [--threads T] [--dtype D]  (or python bench.py --cpu)

Both engines in one dtype: bfloat16 where the CPU multiplies bf16 natively (nanopaged's fast
CPU mode: prepacked oneDNN GEMMs and its C kernels), else float32 (its exact default).

Three rows, each timed for both engines in every round, the order alternating between rounds,
reported as medians: 16 prompts x 64 greedy tokens (HF: one batched, left-padded generate),
1 prompt x 64 tokens, and a 3,000-token prompt prefilled plus 1 token. Every round uses fresh
prompts (a round tag up front), so nanopaged's prefix cache never serves an earlier round.
Both load the same GGUF file; timings on shared cores are noisy, hence the interleaving.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nanopaged import LLM, SamplingParams
from nanopaged.gguf import embedded_gguf
from nanopaged.platform import CPU

NEW_TOKENS = 64
LONG_PROMPT = 3000
QUESTIONS = [
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "Why is the sky blue?",
    "Write a Python function that adds two numbers.",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about the sea.",
    "Explain in two sentences what a GPU is.",
    "What is the boiling point of water?",
    "Summarize the plot of Romeo and Juliet.",
    "How do airplanes stay in the air?",
    "List four prime numbers.",
    "What does a compiler do?",
    "Describe a cat to someone who has never seen one.",
    "Why do we have seasons?",
    "Translate 'good morning' into Spanish.",
    "What is photosynthesis?",
]


def _prompts(tokenizer, round_index: int, count: int) -> list[list[int]]:
    """Chat-formatted token ids; the round tag makes every round's first block new."""
    out = []
    for question in QUESTIONS[:count]:
        conv = [{"role": "user", "content": f"[{round_index}] {question}"}]
        text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def _long_prompt(round_index: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(round_index)
    return torch.randint(100, vocab, (LONG_PROMPT,), generator=gen).tolist()


def _hf_generate(model, tokenizer, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """One batched greedy generate, left-padded, exactly new_tokens per prompt."""
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad,
        )
    return out[:, width:].tolist()


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_cpu_bench(
    rounds: int = 3, threads: int | None = None, dtype: str = "float32"
) -> dict:
    """Median seconds per row for nanopaged and HF over interleaved rounds, and HF / nanopaged;
    both engines run the same weights in the same dtype."""
    import transformers

    if threads is not None:
        torch.set_num_threads(threads)
    gguf = embedded_gguf()
    start = time.perf_counter()
    llm = LLM(device="cpu", dtype=dtype)
    load_s = time.perf_counter() - start
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype)
    ).eval()
    vocab = hf.config.vocab_size
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def rows(r: int) -> dict:
        batch, single = _prompts(tokenizer, r, 16), _prompts(tokenizer, r, 1)
        long = [_long_prompt(r, vocab)]
        return {
            "16 prompts x 64 tokens": (
                lambda: llm.generate(batch, greedy, use_tqdm=False),
                lambda: _hf_generate(hf, tokenizer, batch, NEW_TOKENS),
            ),
            "1 prompt x 64 tokens": (
                lambda: llm.generate(single, greedy, use_tqdm=False),
                lambda: _hf_generate(hf, tokenizer, single, NEW_TOKENS),
            ),
            f"{LONG_PROMPT}-token prefill + 1 token": (
                lambda: llm.generate(long, one, use_tqdm=False),
                lambda: _hf_generate(hf, tokenizer, long, 1),
            ),
        }

    # Warm-up round (round -1): first calls pay one-time costs in both libraries.
    for nano_fn, hf_fn in rows(-1).values():
        nano_fn()
        hf_fn()
    times: dict[str, dict[str, list[float]]] = {}
    for r in range(rounds):
        for name, (nano_fn, hf_fn) in rows(r).items():
            t = times.setdefault(name, {"nanopaged": [], "hf": []})
            order = [("nanopaged", nano_fn), ("hf", hf_fn)]
            for engine, fn in order if r % 2 == 0 else order[::-1]:
                t[engine].append(_timed(fn))
                print(f"  round {r} {name}: {engine} {t[engine][-1]:.2f} s", flush=True)
    result = {"threads": torch.get_num_threads(), "rounds": rounds, "load_s": load_s,
              "dtype": dtype, "rows": {}}  # fmt: skip
    for name, t in times.items():
        nano_s, hf_s = statistics.median(t["nanopaged"]), statistics.median(t["hf"])
        result["rows"][name] = {"nanopaged_s": nano_s, "hf_s": hf_s, "speedup": hf_s / nano_s}
    return result


def print_result(result: dict) -> None:
    print(f"CPU, {result['dtype']}, {result['threads']} threads, median of {result['rounds']} "
          f"interleaved rounds "
          f"(LLM() load {result['load_s']:.1f} s)")
    print(f"{'row':<32} {'nanopaged':>10} {'HF':>10} {'HF/nano':>8}")
    for name, row in result["rows"].items():
        print(f"{name:<32} {row['nanopaged_s']:>9.2f}s {row['hf_s']:>9.2f}s "
              f"{row['speedup']:>7.2f}x")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="weights and activations of both engines (default: bfloat16 on "
                             "CPUs with native bf16, nanopaged's fast CPU mode; else float32, "
                             "its exact default)")  # fmt: skip
    args = parser.parse_args(argv)
    dtype = args.dtype or str(CPU.default_dtype(torch.float32)).removeprefix("torch.")
    result = run_cpu_bench(args.rounds, args.threads, dtype)
    print_result(result)
    return result


if __name__ == "__main__":
    main()
