"""FP8 KV cache accuracy: teacher-forced top-1 agreement and perplexity against full precision.

python benchmarks/fp8_accuracy.py                 embedded SmolLM2 (CPU), benchmarks/
                                                  fp8_accuracy_text.txt, e4m3 and e5m2
python benchmarks/fp8_accuracy.py --scales calculated
                                                  per-layer scales calculated by the engine
                                                  (calculate_kv_scales=True) from a first
                                                  request of the same text, instead of 1.0
python benchmarks/fp8_accuracy.py --per-layer     e4m3 rounding of one layer's K/V at a time
                                                  (the rest in full precision)
python benchmarks/fp8_accuracy.py --gpu [--json PATH]
                                                  random Qwen3-0.6B-shaped bf16 model on CUDA,
                                                  random token sequences, fp8 against bf16 KV
Every position of the text is predicted from the true tokens before it (one prefill through
the engine's paged KV cache, prompt_logprobs' path), with each KV cache dtype in turn.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

from nanopaged import LLM, SamplingParams

TEXT = Path(__file__).resolve().parent / "fp8_accuracy_text.txt"
FORMATS = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def teacher_forced(llm: LLM, sequences: list[list[int]]) -> tuple[list[int], list[float]]:
    """For every position after the first of each sequence: the argmax token, and the
    logprob of the true next token."""
    top1: list[int] = []
    logprobs: list[float] = []
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    for ids in sequences:
        (out,) = llm.generate([ids], params, use_tqdm=False)
        for j, entry in enumerate(out.prompt_logprobs[1:]):
            top1.append(next(t for t, lp in entry.items() if lp.rank == 1))
            logprobs.append(entry[ids[j + 1]].logprob)
    return top1, logprobs


def teacher_forced_hooked(llm: LLM, sequences: list[list[int]], make_hook):
    """teacher_forced with make_hook(i): (k, v) -> (k, v) applied to attention layer i's
    rotated K/V before they are stored (the torch backend's attend: a CPU run)."""
    backend = llm.runner.backend
    layers = llm.runner.attention_layers
    hooks = [make_hook(i) for i in range(len(layers))]
    attend = backend.attend

    def hooked(layer, q, k, v, meta, *rest):
        k, v = hooks[layers.index(layer)](k, v)
        return attend(layer, q, k, v, meta, *rest)

    backend.attend = hooked
    try:
        return teacher_forced(llm, sequences)
    finally:
        del backend.attend


def rounded_kv(llm: LLM, dtype: torch.dtype, sequences: list[list[int]],
               layers: set[int] | None = None):  # fmt: skip
    """teacher_forced with the K/V values of `layers` (default: all) rounded to dtype before
    they are stored: what a KV cache of that dtype gives an fp32 model (a reference for what
    8-bit K/V cost)."""

    def make_hook(i: int):
        def round_kv(k, v):
            if layers is not None and i not in layers:
                return k, v
            return k.to(dtype).to(k.dtype), v.to(dtype).to(v.dtype)

        return round_kv

    return teacher_forced_hooked(llm, sequences, make_hook)


def calculate_scales(llm: LLM, sequences: list[list[int]]) -> None:
    """Let an engine made with calculate_kv_scales=True set its scales from a first request:
    the first sequence less its last token, before teacher_forced's requests."""
    first = sequences[0][:-1]
    llm.generate([first], SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.runner.first_kv_pass is None


def free_memory() -> None:
    """Collect a deleted LLM now, so the next one sizes its cache with its memory free."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def compare(make_llm, sequences: list[list[int]], scales: str) -> dict:
    """Each fp8 format against the model-dtype KV cache on the same sequences."""
    base = make_llm("auto")
    t = time.perf_counter()
    base_top1, base_lp = teacher_forced(base, sequences)
    # An fp32 model: also K/V rounded to bf16, the 16-bit cache's own cost, as a yardstick.
    model_dtype = next(base.runner.model.parameters()).dtype
    bf16 = rounded_kv(base, torch.bfloat16, sequences) if model_dtype == torch.float32 else None
    del base
    free_memory()
    ppl = perplexity(base_lp)
    result = {"positions": len(base_top1), "scales": scales, "perplexity_auto": ppl,
              "seconds_auto": time.perf_counter() - t, "formats": {}}  # fmt: skip
    print(f"{len(base_top1)} positions; KV in the model's dtype: perplexity {ppl:.4f}", flush=True)
    for name, dtype in [*([("bf16 (K/V rounded)", None)] if bf16 else []), *FORMATS.items()]:
        if dtype is None:
            top1, lp = bf16
        else:
            llm = make_llm(name, scales == "calculated")
            if scales == "calculated":
                calculate_scales(llm, sequences)
                result.setdefault("scales_by_format", {})[name] = llm.runner.kv_scales.tolist()
            top1, lp = teacher_forced(llm, sequences)
            del llm
            free_memory()
        agree = sum(a == b for a, b in zip(top1, base_top1)) / len(top1)
        row = {"top1_agreement": agree, "perplexity": perplexity(lp),
               "perplexity_change": perplexity(lp) / ppl - 1}  # fmt: skip
        result["formats"][name] = row
        print(
            f"{name}: top-1 agreement {100 * agree:.2f}%, perplexity {row['perplexity']:.4f} "
            f"({100 * row['perplexity_change']:+.2f}%)",
            flush=True,
        )
    return result


def per_layer(llm: LLM, sequences: list[list[int]]) -> dict:
    """Top-1 agreement and perplexity with one layer's K/V rounded to e4m3 at a time, the
    other layers' in the model's dtype: how the 8-bit cost spreads over the layers."""
    base_top1, base_lp = teacher_forced(llm, sequences)
    ppl = perplexity(base_lp)
    rows = []
    for i in range(len(llm.runner.attention_layers)):
        top1, lp = rounded_kv(llm, torch.float8_e4m3fn, sequences, {i})
        agree = sum(a == b for a, b in zip(top1, base_top1)) / len(top1)
        rows.append({"layer": i, "top1_agreement": agree,
                     "perplexity_change": perplexity(lp) / ppl - 1})  # fmt: skip
        print(f"layer {i}: top-1 agreement {100 * agree:.2f}%, perplexity "
              f"{100 * rows[-1]['perplexity_change']:+.2f}%", flush=True)  # fmt: skip
    agreements = sorted(r["top1_agreement"] for r in rows)
    print(f"one layer in e4m3: agreement {100 * agreements[0]:.2f}-{100 * agreements[-1]:.2f}%"
          f", median {100 * agreements[len(rows) // 2]:.2f}%")  # fmt: skip
    return {"positions": len(base_top1), "perplexity_auto": ppl, "layers": rows}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--gpu", action="store_true", help="random Qwen3-0.6B shape on CUDA")
    parser.add_argument("--scales", choices=["fixed", "calculated"], default="fixed")
    parser.add_argument("--per-layer", action="store_true",
                        help="CPU: e4m3 rounding of one layer's K/V at a time")
    parser.add_argument("--max-tokens", type=int, default=None, help="CPU: first N text tokens")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.gpu:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from bench import QWEN3_0_6B, random_model

        model_dir = str(random_model(QWEN3_0_6B, "qwen3-0.6b", "cuda"))
        rng = random.Random(0)
        sequences = [[rng.randrange(0, 100000) for _ in range(1024)] for _ in range(4)]

        def make_llm(kv: str, calculate: bool = False) -> LLM:
            return LLM(model_dir, kv_cache_dtype=kv, max_model_len=2048, enforce_eager=True,
                       gpu_memory_utilization=0.5, calculate_kv_scales=calculate)  # fmt: skip

        device = torch.cuda.get_device_name()
    else:
        probe = LLM(kv_cache_memory=1 << 20, max_model_len=16)
        ids = probe.get_tokenizer()(TEXT.read_text())["input_ids"][: args.max_tokens]
        del probe
        sequences = [ids]

        def make_llm(kv: str, calculate: bool = False) -> LLM:
            return LLM(kv_cache_dtype=kv, kv_cache_memory=256 << 20, max_model_len=len(ids),
                       calculate_kv_scales=calculate)  # fmt: skip

        device = "cpu"
    if args.per_layer:
        result = {"device": device, **per_layer(make_llm("auto"), sequences)}
    else:
        result = {"device": device, **compare(make_llm, sequences, args.scales)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
