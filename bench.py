"""Throughput on nano-vllm's workload (256 random requests), against the HBM roofline.

python bench.py [--model PATH] [--compare hf] [--json PATH]      throughput
python bench.py --kv-cache-dtype fp8 [--json PATH]                the same with bf16 KV, then
                                                                  fp8 KV, in one process
python bench.py --kernels [--json PATH]                           kernel microbenchmarks
python bench.py --sampling [--rounds 2] [--json PATH]               ShareGPT-like, 7 settings
                                                                  (2 of them JSON schemas)
python bench.py --memory                                          KV memory / sharing figures
python bench.py --latency [--batch 1 8] [--profile]               decode step time, small batches
python bench.py --load-format dummy --model-shape llama3-70b --tensor-parallel-size 8
                 random weights of a published shape from its config.json alone, N GPUs
                 (qwen3-30b-a3b: mixture of experts; its roofline counts the experts touched)
python bench.py --load-format dummy --model-shape qwen3-8b --quantization fp8 awq gptq [--latency]
                 the same dummy shape in bf16, then in each quantized checkpoint format
python bench.py --cpu [--rounds N] [--threads T] [--dtype D] [--json PATH]  CPU: SmolLM2 vs HF
Without --model, a random Qwen3-0.6B-shaped bf16 model is built offline and cached. On a
machine without CUDA the workload shrinks (stated in the output) so it finishes in minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
QWEN3_32B = dict(QWEN3_0_6B, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                 num_attention_heads=64, num_key_value_heads=8)  # fmt: skip
QWEN3_32B["tie_word_embeddings"] = False
LLAMA3_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                  num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                  head_dim=128, max_position_embeddings=8192, rope_theta=500000.0,
                  rms_norm_eps=1e-5, tie_word_embeddings=False)  # fmt: skip
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts=128,
                     num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
QWEN3_8B = dict(QWEN3_0_6B, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8)  # fmt: skip
QWEN3_8B["tie_word_embeddings"] = False
# --model-shape name -> (transformers config class name, shape)
SHAPES = {"qwen3-0.6b": ("Qwen3Config", QWEN3_0_6B), "qwen3-32b": ("Qwen3Config", QWEN3_32B),
          "qwen3-8b": ("Qwen3Config", QWEN3_8B),
          "llama3-70b": ("LlamaConfig", LLAMA3_70B),
          "qwen3-30b-a3b": ("Qwen3MoeConfig", QWEN3_30B_A3B)}  # fmt: skip
TINY = dict(QWEN3_0_6B, hidden_size=256, intermediate_size=768, num_hidden_layers=4)
TINY.update(num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=32000)


def cache_dir() -> Path:
    return Path(os.environ.get("NANOPAGED_CACHE", "~/.cache/nanopaged")).expanduser() / "bench"


def random_model(shape: dict, name: str, device: str) -> Path:
    """A random-weight Qwen3 of the given shape, saved once as bf16 safetensors."""
    path = cache_dir() / name
    if (path / "config.json").is_file() and list(path.glob("*.safetensors")):
        return path
    import transformers

    config = transformers.Qwen3Config(**shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tmp.rename(path)
    return path


# --quantization name -> the quantization_config of a checkpoint in that format, as published:
# Qwen's FP8 (128x128 blocks), llm-compressor's FP8-dynamic (per channel), AWQ and GPTQ int4
# with groups of 128.
QUANT_CONFIGS = {
    "fp8": dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                weight_block_size=[128, 128]),
    "compressed-tensors": dict(
        quant_method="compressed-tensors", format="float-quantized", ignore=["lm_head"],
        config_groups=dict(group_0=dict(
            targets=["Linear"],
            weights=dict(num_bits=8, type="float", strategy="channel", symmetric=True,
                         dynamic=False),
            input_activations=dict(num_bits=8, type="float", strategy="token", symmetric=True,
                                   dynamic=True)))),
    "awq": dict(quant_method="awq", bits=4, group_size=128, version="gemm", zero_point=True),
    "gptq": dict(quant_method="gptq", bits=4, group_size=128, desc_act=False, sym=True,
                 checkpoint_format="gptq"),
}  # fmt: skip


def config_only(name: str, quantization: str | None = None) -> Path:
    """A directory holding just the config.json of a --model-shape (for --load-format dummy),
    with the quantization_config of a --quantization format."""
    import transformers

    cls_name, shape = SHAPES[name]
    path = cache_dir() / (f"{name}-config" + (f"-{quantization}" if quantization else ""))
    config = getattr(transformers, cls_name)(**shape, dtype="bfloat16")
    config.architectures = [cls_name.replace("Config", "ForCausalLM")]
    config.save_pretrained(path)
    if quantization is not None:
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization_config"] = QUANT_CONFIGS[quantization]
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def add_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level tokenizer covering ids [0, vocab_size), so stop strings and grammars can be
    benchmarked on a random model: the 256 bytes, then two- and three-character pieces of
    printable ASCII and space, as most of a real vocabulary is whole characters of text. No
    piece holds '"' or a backslash, so a JSON string goes on until max_tokens.
    (Pieces of arbitrary bytes, 78% of them broken UTF-8, put a random model's rows in the
    middle of a character at most steps, where a grammar's mask walks the whole vocabulary:
    111 us a row there, 33 us with these pieces, 12-19 us over SmolLM2's real tokenizer, a
    JSON schema's mask after each of 200 random allowed tokens, on one CPU core.)"""
    if (path / "tokenizer.json").is_file():
        return
    from itertools import product

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab["<eos>"] = len(vocab)
    # Byte-level spelling: printable ASCII is itself, the space byte is "\u0120".
    letters = [chr(c) for c in range(0x21, 0x7F) if chr(c) not in '"\\'] + ["\u0120"]
    pieces = (a + b for a, b in product(letters, repeat=2))
    triples = ("".join(t) for t in product(letters, repeat=3))
    for piece in (*pieces, *triples):
        if len(vocab) >= vocab_size:
            break
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(path)


def workload(num_seqs: int, max_input_len: int, max_output_len: int):
    """nano-vllm's bench.py requests: random token prompts, random output lengths."""
    random.seed(0)
    prompts = [
        [random.randint(0, 10000) for _ in range(random.randint(100, max_input_len))]
        for _ in range(num_seqs)
    ]
    max_tokens = [random.randint(100, max_output_len) for _ in range(num_seqs)]
    return prompts, max_tokens


def copy_bandwidth_tbps() -> float:
    """Device-to-device copy rate in TB/s, bytes read plus written (median of 20)."""
    x = torch.randn(256 * 2**20, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    times = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    ms = sorted(times[5:])[len(times[5:]) // 2]
    return 2 * x.numel() * x.element_size() / ms / 1e9


def decode_roofline_bytes(llm, prompts, max_tokens) -> float:
    """Fewest HBM bytes the decode steps must read: each running sequence's KV every step,
    plus the weights once per step (steps = the longest request's outputs, all in flight).

    Mixture-of-experts layers count only the experts a step touches: with B sequences in
    flight, each picking top_k of E experts, the expected number of distinct experts is
    E * (1 - (1 - top_k / E) ** B) per layer (routing taken as uniform: each token's choice
    is a uniform top_k-subset, independent of the others; random weights route that way).
    B at step s is the number of requests with more than s outputs.
    """
    from nanopaged.layers.moe import MoEExperts

    c = llm.model_config
    elem = torch.empty((), dtype=llm.kv_cache_dtype).element_size()  # 1 for an fp8 cache
    # Per GPU: under tensor parallelism each reads its own KV heads and weight shard at once.
    kv_per_token = 2 * c.num_layers * llm.runner.num_kv_heads * c.head_dim * elem
    kv_tokens = sum(m * len(p) + m * (m - 1) // 2 for p, m in zip(prompts, max_tokens))
    model = llm.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    experts = [m for m in model.modules() if isinstance(m, MoEExperts)]
    if not experts:
        return kv_tokens * kv_per_token + max(max_tokens) * weight_bytes
    all_experts = sum((m.w13.numel() + m.w2.numel()) * m.w13.element_size() for m in experts)
    dense_bytes = weight_bytes - all_experts
    # one expert of every MoE layer (this rank's shard of it)
    per_expert = all_experts / c.num_experts
    e, k = c.num_experts, c.num_experts_per_tok
    expert_bytes = sum(
        e * (1 - (1 - k / e) ** sum(m > s for m in max_tokens)) * per_expert
        for s in range(max(max_tokens))
    )
    return kv_tokens * kv_per_token + max(max_tokens) * dense_bytes + expert_bytes


def run_hf(model_dir: Path, prompts, max_tokens, num: int) -> dict:
    """HF transformers continuous batching on the first `num` requests of the workload."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="paged|sdpa"
    ).to("cuda")
    sub_prompts, sub_max = prompts[:num], max_tokens[:num]
    gen = transformers.GenerationConfig(
        max_new_tokens=max(sub_max),
        do_sample=True,
        temperature=0.6,
        eos_token_id=None,
        pad_token_id=0,
    )
    model.generate_batch(
        inputs=[p[:16] for p in sub_prompts[:4]],
        generation_config=transformers.GenerationConfig(
            max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0
        ),
    )
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = model.generate_batch(inputs=sub_prompts, generation_config=gen)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    tokens = sum(len(o.generated_tokens) for o in outs.values())
    del model
    torch.cuda.empty_cache()
    return {"hf_requests": num, "hf_output_tokens": tokens, "hf_seconds": dt,
            "hf_tok_per_s": tokens / dt}  # fmt: skip


@contextlib.contextmanager
def new_kernel_variants(detail: bool = False):
    """Yield a list that collects the Triton kernel variants first launched inside the block
    (each one a compile, or a load from Triton's disk cache): a timed run should find none.
    detail: each variant's whole description (its specialisation), not just its name."""
    found: list[str] = []
    runtime = getattr(getattr(sys.modules.get("triton"), "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        yield found
        return

    def hook(*, repr: str, **_) -> None:
        found.append(repr if detail else repr.split("[", 1)[0])

    old, runtime.jit_cache_hook = runtime.jit_cache_hook, hook
    try:
        yield found
    finally:
        runtime.jit_cache_hook = old


def warm_up(llm, prompts) -> None:
    """A short generate over the workload's first prompts, so Triton compiles the kernel
    variants its shapes need (they are cached on disk) before anything is timed."""
    from nanopaged import SamplingParams

    p = SamplingParams(temperature=0.6, max_tokens=24, ignore_eos=True)
    llm.generate(prompts[:20], p, use_tqdm=False)
    llm.generate(prompts[:1], p, use_tqdm=False)
    # More prompts than one step's token budget: chunked prompts (with and without a cached
    # part) in steps mixed with decodes, the variants the timed run meets.
    llm.generate(
        prompts[:48], SamplingParams(temperature=0.6, max_tokens=4, ignore_eos=True), use_tqdm=False
    )


def sharegpt_like(n: int = 400):
    """BENCH.md's sampling workload: lognormal ShareGPT-like prompt and output lengths."""
    import math

    rng = random.Random(0)
    inputs = [min(2000, max(4, int(rng.lognormvariate(math.log(160), 1.0)))) for _ in range(n)]
    outputs = [min(1500, max(4, int(rng.lognormvariate(math.log(300), 0.9)))) for _ in range(n)]
    prompts = [[rng.randrange(0, 100000) for _ in range(k)] for k in inputs]
    return prompts, outputs


SAMPLING_SETTINGS = {
    "greedy": dict(temperature=0),
    "t0.8 top_p0.95 seed": dict(temperature=0.8, top_p=0.95, seed=True),
    "top_k40 min_p0.05": dict(temperature=1.0, top_k=40, min_p=0.05),
    "n=4": dict(temperature=0.8, n=4),
    "logprobs=5 + stop string": dict(temperature=0.8, logprobs=5, stop=["\x00never\x00"]),
    # Greedy with every row constrained, by one schema for all rows or a schema per row.
    "json schema (shared)": dict(temperature=0, json="shared"),
    "json schema (per row)": dict(temperature=0, json="per row"),
}


def bench_schema(row: int, salt: str) -> dict:
    """The JSON schema of a constrained row: one object shape, with the row's own property
    names, enum values and bounds (so each row's schema compiles on its own; salt: each run's
    schemas are its own, their compiles inside its timing). Bounded fields first, free text
    last, so a row writes until its max_tokens as the greedy row does."""
    k = f"{salt}_{row}"
    properties = {
        f"id_{k}": {"type": "integer", "minimum": row, "maximum": row + 1000},
        f"kind_{k}": {"enum": [f"a{k}", f"b{k}", f"c{k}"]},
        f"tags_{k}": {"type": "array", "items": {"type": "string", "maxLength": 8},
                      "maxItems": 1 + row % 3},
        f"ok_{k}": {"type": "boolean"},
        f"text_{k}": {"type": "string"},
    }  # fmt: skip
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}  # fmt: skip


def _setting_params(setting: dict, outputs: list[int], salt: int) -> list:
    """One SamplingParams per request of the sampling workload under `setting` (salt: the
    run's, which its schemas carry)."""
    from nanopaged import SamplingParams, StructuredOutputsParams

    setting = dict(setting)
    seeded = setting.pop("seed", False)
    json_rows = setting.pop("json", None)
    params = []
    for i, m in enumerate(outputs):
        if json_rows is not None:
            shared = json_rows == "shared"  # a schema no per-row run has
            schema = bench_schema(0 if shared else i, f"s{salt}" if shared else str(salt))
            setting["structured_outputs"] = StructuredOutputsParams(json=schema)
        params.append(SamplingParams(ignore_eos=True, max_tokens=m, seed=i if seeded else None,
                                     **setting))  # fmt: skip
    return params


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _structured_figures(llm, started: float) -> dict | None:
    """The constrained run's grammar compiles and masks (nanopaged.structured.StructuredStats),
    with the wall time from generate() to its first mask; None when nothing was constrained."""
    backend = llm.runner.sampler.structured
    if backend is None or not backend.stats.mask_steps:
        return None
    stats = backend.stats
    return dict(stats.summary(), first_mask_after_s=stats.first_mask_at - started)


def _sampling_run(llm, row_prompts, outputs, setting, bw, salt: int) -> dict:
    """One timed generate of the sampling workload under one setting (bw: the device's copy
    rate for the roofline, None on a CPU)."""
    n = setting.get("n", 1)
    params = _setting_params(setting, outputs, salt)
    steps0, ahead0 = llm.scheduler.num_steps, llm.scheduler.num_advanced_steps
    spec0 = llm.spec_stats()
    if llm.runner.sampler.structured is not None:
        llm.runner.sampler.structured.stats.reset()
    _synchronize()
    with new_kernel_variants() as variants:
        t = time.perf_counter()
        outs = llm.generate(row_prompts, params, use_tqdm=False)
        _synchronize()
        seconds = time.perf_counter() - t
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    # Roofline: every sample reads its own KV (shared prompt blocks read once per sample).
    roof_s = None
    if bw is not None:
        roof_s = decode_roofline_bytes(llm, row_prompts * n, outputs * n) / (bw * 1e12)
    spec = llm.spec_stats().since(spec0)
    row = dict(
        acceptance_rate=spec.acceptance_rate, mean_accepted_length=spec.mean_accepted_length,
        num_draft_tokens=spec.num_draft_tokens,
        output_tokens=tokens, seconds=seconds, tok_per_s=tokens / seconds,
        fraction_of_roofline=None if roof_s is None else roof_s / seconds,
        preemptions=llm.scheduler.num_preemptions,
        async_step_fraction=(llm.scheduler.num_advanced_steps - ahead0)
        / max(1, llm.scheduler.num_steps - steps0), kernel_variants_in_timed_run=variants,
    )  # fmt: skip
    if "json" in setting:
        row["structured"] = _structured_figures(llm, t)
        row["finished_stop"] = sum(c.finish_reason == "stop" for o in outs for c in o.outputs)
    return row


def _roofline(row: dict) -> str:
    fraction = row["fraction_of_roofline"]
    return "  n/a of roofline" if fraction is None else f"{100 * fraction:5.1f}% of roofline"


def _print_structured(name: str, figures: dict | None) -> None:
    if figures is None:
        return
    f = figures
    print(f"{'':28s} grammars: {f['compiles']} compiled, {1e3 * f['compile_mean_s']:.2f} ms "
          f"mean, {1e3 * f['compile_max_s']:.2f} ms max, {f['compile_total_s']:.3f} s in all; "
          f"first mask {f['first_mask_after_s']:.3f} s after generate() "
          f"({f['waited_for_compile_s']:.3f} s blocked on compiles); per step over "
          f"{f['mask_steps']} steps: sampler waited {f['mask_mean_ms']:.3f} ms for masks, "
          f"matchers advanced in {f['accept_mean_ms']:.3f} ms, masks filled ahead in "
          f"{f['prefetch_mean_ms']:.3f} ms", flush=True)  # fmt: skip


def sampling_settings(speculative_config: dict | None) -> dict:
    """SAMPLING_SETTINGS, less those speculative decoding refuses (logprobs, grammars) when it
    is on."""
    if speculative_config is None:
        return SAMPLING_SETTINGS
    refused = [n for n, s in SAMPLING_SETTINGS.items() if "logprobs" in s or "json" in s]
    print(f"--speculative-config: {', '.join(refused)} left out (speculation refuses them)")
    return {name: s for name, s in SAMPLING_SETTINGS.items() if name not in refused}


def run_sampling(args) -> dict:
    """The sampling workload under each setting, one process, tok/s and roofline fraction."""
    from nanopaged import LLM, SamplingParams

    cuda = torch.cuda.is_available()
    shape, name = (QWEN3_0_6B, "qwen3-0.6b") if cuda else (TINY, "qwen3-tiny")
    model_dir = Path(args.model) if args.model else random_model(shape, name, "cuda" if cuda
                                                                 else "cpu")  # fmt: skip
    if not args.model:
        add_tokenizer(model_dir, shape["vocab_size"])
    prompts, outputs = sharegpt_like()
    # Each run's prompts start with a token of its own, from `base` up.
    base = 100000
    kwargs = dict(gpu_memory_utilization=args.gpu_memory_utilization)
    if not cuda:  # a check that every row runs and prints sane figures, in a minute or two
        base = 30000
        prompts = [[t % base for t in p[:128]] for p in prompts[:16]]
        outputs = [min(m, 64) for m in outputs[:16]]
        kwargs = dict(device="cpu")
        print(f"no CUDA: {len(prompts)} requests, inputs <= 128, outputs <= 64, tiny model")
    llm = LLM(str(model_dir), max_model_len=4096, enforce_eager=args.enforce_eager,
              speculative_config=args.speculative_config, **kwargs)
    settings = sampling_settings(args.speculative_config)
    if args.rows:
        settings = {n: s for n, s in settings.items() if any(w in n for w in args.rows)}
    warm_up(llm, prompts)
    # The whole workload once, untimed: the first timed row (greedy) otherwise paid for kernel
    # variants and allocations the later rows found ready (it measured 13% below them).
    warm = [[base + len(SAMPLING_SETTINGS), *p] for p in prompts]
    llm.generate(warm, [SamplingParams(ignore_eos=True, max_tokens=m) for m in outputs],
                 use_tqdm=False)  # fmt: skip
    # And each setting briefly, so no row pays a one-time cost inside its timing (the stop
    # strings' token byte table, ~0.3 s at a 152k vocabulary, built at the first request;
    # the grammars' tokenizer, at the first constrained one).
    for setting in settings.values():
        llm.generate(warm[:8], _setting_params(setting, [4] * 8, salt=-1), use_tqdm=False)
    bw = copy_bandwidth_tbps() if cuda else None
    device = torch.cuda.get_device_name() if cuda else "cpu"
    result = {"device": device, "copy_tb_per_s": bw, "settings": {}, "rounds": args.rounds,
              "speculative_config": args.speculative_config}  # fmt: skip
    # The settings run in turn, `rounds` times over; each setting's fastest run counts. On a
    # shared machine one run in several loses 1-2 s to long host stalls between steps
    # (launch-to-launch gaps over 20 ms summing 0.3 s in one run of a row and 2.0 s in
    # another, same schedule), which moved single rows by up to 20%.
    for round_index in range(args.rounds):
        for row_index, (name, setting) in enumerate(settings.items()):
            # A first token of the run's own: no run's prompts hit blocks an earlier run cached.
            first = base + row_index + round_index * (len(SAMPLING_SETTINGS) + 1)
            row = _sampling_run(llm, [[first, *p] for p in prompts], outputs, setting, bw,
                                salt=round_index)  # fmt: skip
            runs = result["settings"].setdefault(name, {"runs": []})["runs"]
            runs.append(row)
            best = min(runs, key=lambda r: r["seconds"])
            result["settings"][name].update(best)
            new = sorted(set(row["kernel_variants_in_timed_run"]))
            print(
                f"{name:28s} {row['output_tokens']:7d} tok {row['seconds']:6.2f} s "
                f"{row['tok_per_s']:8.0f} tok/s {_roofline(row)}, "
                f"{100 * row['async_step_fraction']:3.0f}% async (round {round_index + 1})"
                + (f"; new kernel variants: {', '.join(new)}" if new else "")
                + (f"; {100 * row['acceptance_rate']:.1f}% of {row['num_draft_tokens']} drafts "
                   f"accepted, {row['mean_accepted_length']:.2f} tokens per verified row"
                   if args.speculative_config else ""),
                flush=True,
            )  # fmt: skip
            _print_structured(name, row.get("structured"))
    base = result["settings"]["greedy"]["tok_per_s"]
    print(f"fastest of {args.rounds} run(s) each:")
    for name, row in result["settings"].items():
        row["of_greedy"] = row["tok_per_s"] / base
        print(f"{name:28s} {row['tok_per_s']:8.0f} tok/s {_roofline(row)}  "
              f"{row['of_greedy']:.2f}x of greedy")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="HF model dir or .gguf (default: random Qwen3-0.6B)"
    )
    parser.add_argument("--num-seqs", type=int, default=None)
    parser.add_argument("--max-input-len", type=int, default=None)
    parser.add_argument("--max-output-len", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--compare", choices=["hf"], default=None)
    parser.add_argument("--hf-requests", type=int, default=64, help="workload subset HF runs")
    parser.add_argument("--json", default=None, help="write every figure here")
    parser.add_argument("--kernels", action="store_true", help="kernel microbenchmarks")
    parser.add_argument("--memory", action="store_true", help="KV memory and sharing figures")
    parser.add_argument("--sampling", action="store_true", help="ShareGPT-like, 7 samplings")
    parser.add_argument("--rows", nargs="+", default=None, metavar="WORD",
                        help="--sampling: only the settings whose name holds one of these")
    parser.add_argument("--rounds", type=int, default=2,
                        help="--sampling: runs of each setting, in turn; the fastest counts")
    parser.add_argument("--latency", action="store_true", help="decode step time at batch 1, 8")
    parser.add_argument("--speculative-config", type=json.loads, default=None,
                        help="speculative decoding (throughput, --latency, --sampling), vLLM's "
                             "dict as JSON, "
                             "e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'; "
                             "prints acceptance rate and mean accepted length")  # fmt: skip
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per model")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                        help="dummy: random weights from config.json alone")  # fmt: skip
    parser.add_argument("--model-shape", choices=list(SHAPES), default=None,
                        help="with --load-format dummy: a published model's shape")  # fmt: skip
    parser.add_argument("--quantization", nargs="+", choices=list(QUANT_CONFIGS), default=None,
                        help="with --model-shape: each format after bf16, one process")  # fmt: skip
    parser.add_argument("--cpu", action="store_true", help="CPU: embedded SmolLM2 against HF")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
        default="auto",
        help="an fp8 choice runs 'auto' first, then it",
    )
    args, rest = parser.parse_known_args(argv)

    root = Path(__file__).resolve().parent
    sys.path.insert(0, str(root / "benchmarks"))
    if args.kernels:
        import kernel_bench

        rows = kernel_bench.main(rest + (["--json", args.json] if args.json else []))
        import sampler_bench

        sampler_rows = sampler_bench.run_sampler_bench("cuda")
        import moe_bench

        moe_rows = moe_bench.main(
            ["--json", str(Path(args.json).with_name(Path(args.json).stem + "_moe.json"))]
            if args.json else []
        )  # fmt: skip
        if args.json:
            out = Path(args.json)
            out.with_name(out.stem + "_sampler.json").write_text(json.dumps(sampler_rows, indent=2))
        return rows + sampler_rows + moe_rows
    if args.latency:
        import latency_bench

        return latency_bench.main(rest + _latency_args(args))
    if args.memory:
        import memory_bench

        return memory_bench.main(rest + (["--json", args.json] if args.json else []))
    if args.cpu:
        import cpu_bench

        result = cpu_bench.main(rest)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
        return result
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")

    if args.sampling:
        return run_sampling(args)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    num_seqs = args.num_seqs or (256 if cuda else 16)
    max_in = args.max_input_len or (1024 if cuda else 128)
    max_out = args.max_output_len or (1024 if cuda else 128)
    if args.quantization and args.model_shape is None:
        parser.error("--quantization goes with --load-format dummy and --model-shape")
    if args.model_shape is not None:
        if args.load_format != "dummy" or args.model:
            parser.error("--model-shape goes with --load-format dummy and no --model")
        model_dir = config_only(args.model_shape)
    elif cuda:
        model_dir = (
            Path(args.model) if args.model else random_model(QWEN3_0_6B, "qwen3-0.6b", device)
        )
    else:
        model_dir = Path(args.model) if args.model else random_model(TINY, "qwen3-tiny", device)
        print(
            f"no CUDA: small CPU workload ({num_seqs} requests, inputs <= {max_in}, outputs "
            f"<= {max_out}) on {'the given model' if args.model else 'a tiny random Qwen3'}"
        )
    prompts, max_tokens = workload(num_seqs, max_in, max_out)

    runs = {}
    for kv in dict.fromkeys(["auto", args.kv_cache_dtype]):
        runs[kv] = run_throughput(args, model_dir, prompts, max_tokens, kv)
        gc.collect()  # the LLM's KV cache and graphs go before the next one profiles
        if cuda:
            torch.cuda.empty_cache()
    result = runs[args.kv_cache_dtype]
    if len(runs) > 1:
        auto = runs["auto"]
        print(
            f"KV {args.kv_cache_dtype} / auto: {result['tok_per_s'] / auto['tok_per_s']:.2f}x "
            f"throughput, {result['kv_blocks'] / auto['kv_blocks']:.2f}x KV blocks"
        )
    if args.compare == "hf" and cuda:
        result.update(run_hf(model_dir, prompts, max_tokens, args.hf_requests))
        result["ratio_to_hf"] = result["tok_per_s"] / result["hf_tok_per_s"]
        print(
            f"HF transformers continuous batching (paged|sdpa), first {args.hf_requests} "
            f"requests: {result['hf_output_tokens']} tokens in {result['hf_seconds']:.1f} s = "
            f"{result['hf_tok_per_s']:.0f} tok/s; nanopaged / HF = {result['ratio_to_hf']:.1f}x"
        )
    if len(runs) > 1:
        result = {"kv_cache_dtype": runs}
    if args.quantization:
        result = {"bf16": result, **run_quantized(args, prompts, max_tokens, result)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


def _latency_args(args) -> list[str]:
    """The options of this command line that benchmarks/latency_bench.py takes too."""
    passed = ["--json", args.json] if args.json else []
    passed += ["--model", args.model] if args.model else []
    passed += ["--model-shape", args.model_shape] if args.model_shape else []
    passed += ["--quantization", *args.quantization] if args.quantization else []
    if args.speculative_config is not None:
        passed += ["--speculative-config", json.dumps(args.speculative_config)]
    return passed + ["--enforce-eager"] * args.enforce_eager


def run_quantized(args, prompts, max_tokens, bf16: dict) -> dict:
    """The throughput workload on the --model-shape in each --quantization format."""
    runs = {}
    for quantization in args.quantization:
        model_dir = config_only(args.model_shape, quantization)
        runs[quantization] = run_throughput(args, model_dir, prompts, max_tokens, "auto",
                                            quantization)  # fmt: skip
        runs[quantization]["ratio_to_bf16"] = runs[quantization]["tok_per_s"] / bf16["tok_per_s"]
        print(f"{quantization} / bf16: {runs[quantization]['ratio_to_bf16']:.2f}x throughput")
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return runs


def run_throughput(
    args, model_dir: Path, prompts, max_tokens, kv_cache_dtype: str, quantization: str | None = None
) -> dict:
    """The throughput workload on a new LLM with this KV cache dtype; its figures, printed."""
    from nanopaged import LLM, SamplingParams
    from nanopaged.quantization import weight_bytes

    cuda = torch.cuda.is_available()
    num_seqs = len(prompts)
    t = time.perf_counter()
    llm = LLM(
        str(model_dir),
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        load_format=args.load_format,
        kv_cache_dtype=kv_cache_dtype,
        speculative_config=args.speculative_config,
    )
    load_s = time.perf_counter() - t
    warm_up(llm, prompts)
    steps0, ahead0 = llm.scheduler.num_steps, llm.scheduler.num_advanced_steps
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    if cuda:
        torch.cuda.synchronize()
    with new_kernel_variants() as variants:
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "model": str(
            args.model
            or (f"{args.model_shape} shape, dummy weights" if args.model_shape else None)
            or ("random Qwen3-0.6B shape, bf16" if cuda else "tiny random")
        ),
        "requests": num_seqs,
        "prompt_tokens": sum(map(len, prompts)),
        "output_tokens": output_tokens,
        "seconds": seconds,
        "tok_per_s": output_tokens / seconds,
        "load_seconds": load_s,
        "kv_blocks": llm.runner.num_blocks,
        "preemptions": llm.scheduler.num_preemptions,
        "enforce_eager": args.enforce_eager,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "async_step_fraction": (llm.scheduler.num_advanced_steps - ahead0)
        / max(1, llm.scheduler.num_steps - steps0),
        "tensor_parallel_size": args.tensor_parallel_size,
        "load_format": args.load_format,
        "kv_cache_dtype": kv_cache_dtype,
        "quantization": quantization,
        "speculative_config": args.speculative_config,
        "weight_bytes": weight_bytes(llm.runner.model),
        "kernel_variants_in_timed_run": variants,
    }
    if cuda:
        bw = copy_bandwidth_tbps()
        roof_bytes = decode_roofline_bytes(llm, prompts, max_tokens)
        roof_s = roof_bytes / (bw * 1e12)
        result.update(
            copy_tb_per_s=bw,
            roofline_decode_bytes=roof_bytes,
            roofline_seconds=roof_s,
            roofline_tok_per_s=output_tokens / roof_s,
            fraction_of_roofline=roof_s / seconds,
        )
    print(
        f"[KV {kv_cache_dtype}{', ' + quantization if quantization else ''}] {result['device']}: "
        f"{result['weight_bytes'] / 2**30:.2f} GiB of weights; {output_tokens} output tokens in "
        f"{seconds:.2f} s = {result['tok_per_s']:.0f} tok/s ({num_seqs} requests, "
        f"{result['prompt_tokens']} prompt tokens, {result['preemptions']} preemptions, "
        f"{100 * result['async_step_fraction']:.0f}% of steps asynchronous)"
    )
    if cuda:
        print(
            f"copy bandwidth {result['copy_tb_per_s']:.2f} TB/s; decode roofline "
            f"{result['roofline_decode_bytes'] / 1e12:.1f} TB = {result['roofline_seconds']:.2f}"
            f" s = {result['roofline_tok_per_s']:.0f} tok/s; achieved "
            f"{100 * result['fraction_of_roofline']:.1f}% of it"
        )
    if variants:
        print(f"kernel variants first launched inside the timed run: {len(variants)} "
              f"({', '.join(sorted(set(variants)))})")  # fmt: skip
    llm.shutdown()  # tensor-parallel workers
    return result


if __name__ == "__main__":
    main()
