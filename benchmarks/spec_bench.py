"""Speculative decoding on a repetitive workload: tokens/s with and without it, same process.

python benchmarks/spec_bench.py [--model PATH] [--batch 1 4 16 32] [--max-tokens 256] [--rounds 2]
                                [--draft PATH --kv-cache-memory BYTES] [--json PATH]

The workload ("edit"): 8 chat requests whose answers mostly repeat text the prompt holds,
as in code editing and proofreading: four Python functions, each to be returned whole with
one change (rename a variable, add a docstring, add type hints, fix an off-by-one), and four
paragraphs, each to be returned with one word replaced or its typos fixed. Greedy decoding,
up to --max-tokens tokens each, EOS honoured. The default model is the embedded
SmolLM2-135M-Instruct (a real model: acceptance depends on what it writes).

For each batch size B the requests run in groups of B (the 8 repeated to fill the groups,
each group a `chat` of B conversations), without speculation and with each configuration:
n-gram (--ngram: k = 4 with lookups of 2..4 tokens, k = 8 with 1..4), and a draft model with
--draft. Each LLM is built, runs all 8
conversations once at each B untimed (every kernel variant compiled), then is timed on
--groups groups. The configurations take turns for --rounds rounds, each on a fresh LLM; the
fastest round counts. Each timed group also runs once for 1 token (prefix caching off, so it
prefills again): decode tokens/s counts the tokens after the first over the time the full run
takes beyond that one (as `bench.py --latency` times a step). Reported: output tokens/s and
decode tokens/s, each with its ratio to no speculation at the same B, the acceptance rate and
the mean accepted length.
Speculation switches off above disable_by_batch_size; here it is set off (None) so that each
batch size shows what speculating costs or gains there.

--draft-layers N adds a draft_model row whose draft is the model's own first N decoder layers
(with its embeddings, final norm and LM head: real weights, the same tokenizer), a pair whose
acceptance can be measured without a second download.

python benchmarks/spec_bench.py --verify-cost --model-shape qwen3-8b [--draft-shape qwen3-0.6b]
                                [--batch 1 8]

What one verifying step costs against a decode step, on dummy weights of a bench.py shape
(acceptance means nothing there): 300-token random prompts, 128 greedy tokens, first without
speculation, then with a proposer that gives every row k = 4 drafts each step (its last
token repeated: nearly always rejected, so each step emits one token and its time is one
verifying step's). The speed-up at a mean accepted length L (tokens per verifying step) is
then L x (decode step / verifying step). With --draft-shape, a draft model of that shape
proposes instead (dummy weights both: its drafts are rejected too), so a step's time is the
draft's k passes plus the verification.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # nanopaged, bench

CODE = [
    '''def moving_average(values, window):
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result''',
    '''def parse_config(lines):
    config = {}
    section = None
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            config[section] = {}
        elif "=" in line and section is not None:
            key, value = line.split("=", 1)
            config[section][key.strip()] = value.strip()
    return config''',
    '''def merge_sorted(a, b):
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out''',
    '''def count_words(text):
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?")
        if word:
            counts[word] = counts.get(word, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return ranked[:10]''',
]
CODE_TASKS = [
    "Repeat the following code exactly, renaming the variable `total` to `running_sum`",
    "Repeat the following code exactly, renaming the function to `read_config`",
    "Repeat the following code exactly, adding a comment line before the return",
    "Repeat the following code exactly, changing `[:10]` to `[:20]`",
]
TEXTS = [
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. Every "
    "night its keeper climbed the narrow stairs, lit the lamp and watched the ships pass in "
    "the dark. When the storms came, the light was the only thing the sailors could see, and "
    "many of them owed their lives to the quiet man who never missed a single night.",
    "Our team meets every Monday at nine to plan the week. We review the open tickets, agree "
    "on priorities and assign the work. On Friday we meet again to look at what was finished, "
    "what is blocked and what we learned. Notes from both meetings are shared with everyone "
    "on the project the same day.",
    "To bake the bread, mix the flour, water, salt and yeast in a large bowl until a soft "
    "dough forms. Knead it for ten minutes, then leave it to rise in a warm place for an hour. "
    "Shape the loaf, let it rise again for thirty minutes and bake it at two hundred degrees "
    "for about forty minutes, until the crust is golden.",
    "The library will be closed on Saturday for maintenence. Books that are due that day can "
    "be returned on Monday without a fine. The online catalogue and the e-book service stay "
    "avaliable during the closure, and the reading room will reopen with longer hours next "
    "week.",
]
TEXT_TASKS = [
    "Repeat the following text, replacing the word 'lighthouse' with 'tower'",
    "Repeat the following text, replacing 'Monday' with 'Tuesday'",
    "Repeat the following text exactly, replacing 'bread' with 'loaf'",
    "Repeat the following text with its spelling mistakes corrected",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}  # fmt: skip


def edit_workload() -> list[list[dict]]:
    """The 8 conversations of the workload (see the module docstring)."""
    code = [f"{task}:\n\n```python\n{src}\n```"
            for task, src in zip(CODE_TASKS, CODE)]  # fmt: skip
    text = [f"{task}:\n\n{src}" for task, src in zip(TEXT_TASKS, TEXTS)]
    return [[{"role": "user", "content": c}] for c in code + text]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed_chat(llm, convs, params) -> tuple[float, list]:
    _sync()
    t = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    _sync()
    return time.perf_counter() - t, outs


def run_config(model: str, spec: dict | None, batches: list[int], max_tokens: int,
               groups: int, llm_kwargs: dict) -> list[dict]:  # fmt: skip
    """One LLM with this speculative_config: per batch size, tok/s over `groups` timed groups."""
    from nanopaged import LLM, SamplingParams

    spec = None if spec is None else {**spec, "disable_by_batch_size": None}
    llm = LLM(model, speculative_config=spec, **llm_kwargs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    first = SamplingParams(temperature=0, max_tokens=1)
    convs = edit_workload()
    rows = []
    for batch in batches:
        pool = [convs[i % len(convs)] for i in range(batch * groups)]
        for g in range(0, len(convs), batch):  # warm-up: every conversation at this B
            llm.chat([convs[(g + i) % len(convs)] for i in range(batch)], params, use_tqdm=False)
        stats0 = llm.spec_stats() if spec else None
        tokens = decode_tokens = 0
        seconds = first_seconds = 0.0
        for g in range(groups):
            group = pool[g * batch : (g + 1) * batch]
            first_seconds += _timed_chat(llm, group, first)[0]
            t, outs = _timed_chat(llm, group, params)
            seconds += t
            tokens += sum(len(o.outputs[0].token_ids) for o in outs)
            decode_tokens += sum(len(o.outputs[0].token_ids) - 1 for o in outs)
        decode_seconds = seconds - first_seconds
        row = dict(batch=batch, tokens=tokens, seconds=seconds, tok_per_s=tokens / seconds,
                   decode_tok_per_s=decode_tokens / decode_seconds)  # fmt: skip
        if spec:
            row["speculation"] = llm.spec_stats().since(stats0).as_dict()
        rows.append(row)
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


class _RepeatLast:
    """A proposer of k drafts for every row: its last token, k times (--verify-cost)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, seqs_tokens: list[list[int]], seq_ids: list[int]) -> list[list[int]]:
        return [[tokens[-1]] * self.k for tokens in seqs_tokens]

    def free(self, seq_id: int) -> None:
        pass

    def free_all(self) -> None:
        pass


def verify_cost(model_dir: str, batches: list[int], load_format: str,
                draft_dir: str | None = None) -> dict:  # fmt: skip
    """ms per decode step and per verifying step of k = 4 drafts, per batch size; with a
    draft, also per step of the draft model proposing (its k passes) and the verification."""
    import random

    from nanopaged import LLM, SamplingParams

    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    rows = {}
    configs = [("decode", None), ("verify k=4", NGRAM)]
    if draft_dir is not None:
        configs.append(("draft_model k=4", {"method": "draft_model", "model": draft_dir,
                                            "num_speculative_tokens": 4}))  # fmt: skip
    for name, spec in configs:
        spec = None if spec is None else {**spec, "disable_by_batch_size": None}
        # A draft model's cache needs a budget on a GPU: 8 GiB for both (256 KV blocks and
        # more at these shapes).
        llm = LLM(model_dir, load_format=load_format, max_model_len=2048,
                  speculative_config=spec,
                  kv_cache_memory=8 << 30 if name.startswith("draft") else None)  # fmt: skip
        if name == "verify k=4":
            llm.scheduler.proposer = _RepeatLast(spec["num_speculative_tokens"])
        for batch in batches:
            prompts = lambda batch=batch: [[rng.randrange(1000, 30000) for _ in range(300)]  # noqa: E731
                               for _ in range(batch)]  # fmt: skip
            llm.generate(prompts(), params, use_tqdm=False)  # warm-up
            steps0 = llm.scheduler.num_steps
            _sync()
            t = time.perf_counter()
            llm.generate(prompts(), params, use_tqdm=False)
            _sync()
            ms = (time.perf_counter() - t) * 1e3 / (llm.scheduler.num_steps - steps0)
            rows.setdefault(batch, {})[name] = ms
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    for batch, r in rows.items():
        for name, _ in configs[1:]:
            print(f"batch {batch:3d}: decode step {r['decode']:.3f} ms, {name} step "
                  f"{r[name]:.3f} ms = {r[name] / r['decode']:.2f}x", flush=True)  # fmt: skip
    return rows


def early_exit_draft(model: str, layers: int) -> str:
    """A draft of real weights for --draft-layers: a copy of model (a checkpoint directory, or
    a GGUF file, converted) with only its first `layers` decoder layers, its embeddings, final
    norm and LM head kept, so it shares the tokenizer; in a temporary directory."""
    import re
    import shutil
    import tempfile

    from safetensors.torch import load_file, save_file

    from nanopaged.gguf import convert_gguf

    src = Path(model)
    if src.is_file():
        src = convert_gguf(src)
    config = json.loads((src / "config.json").read_text())
    if not 0 < layers < config["num_hidden_layers"]:
        raise ValueError(f"--draft-layers must be in [1, {config['num_hidden_layers'] - 1}], "
                         f"got {layers}")  # fmt: skip
    out = Path(tempfile.mkdtemp(prefix="spec-bench-draft-"))
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith(("model", "nanopaged_")):
            shutil.copy(f, out)
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    kept = {}
    for f in src.glob("*.safetensors"):
        for name, tensor in load_file(f).items():
            layer = re.match(r"model\.layers\.(\d+)\.", name)
            if layer is None or int(layer.group(1)) < layers:
                kept[name] = tensor
    save_file(kept, out / "model.safetensors")
    return str(out)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--groups", type=int, default=8, help="timed groups per batch size")
    parser.add_argument("--rounds", type=int, default=2, help="turns of each configuration")
    parser.add_argument("--ngram", nargs="+", default=["4:2:4", "8:1:4"],
                        help="n-gram configurations, each k:prompt_lookup_min:prompt_lookup_max")
    parser.add_argument("--draft", default=None, help="a draft model for a draft_model row")
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="a draft_model row whose draft is the model's first N layers")
    parser.add_argument("--kv-cache-memory", type=int, default=None,
                        help="bytes of KV cache (a draft_model run on a GPU needs it)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", default=None)
    parser.add_argument("--verify-cost", action="store_true",
                        help="verifying vs decode step time, dummy weights of --model-shape")
    parser.add_argument("--model-shape", default="qwen3-8b", help="--verify-cost: a bench.SHAPES")
    parser.add_argument("--draft-shape", default=None,
                        help="--verify-cost: also a draft model of this shape (dummy weights)")
    args = parser.parse_args(argv)
    if args.verify_cost:
        import bench

        model_dir = str(bench.config_only(args.model_shape))
        draft = args.draft_shape and str(bench.config_only(args.draft_shape))
        result = {"device": torch.cuda.get_device_name(), "model_shape": args.model_shape,
                  "draft_shape": args.draft_shape,
                  "rows": verify_cost(model_dir, args.batch, "dummy", draft)}  # fmt: skip
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
        return result
    from nanopaged.gguf import embedded_gguf

    model = args.model or str(embedded_gguf())
    # No prefix caching: each group's prompts are prefilled in both of its timed runs.
    llm_kwargs = dict(dtype=args.dtype, max_model_len=2048, kv_cache_memory=args.kv_cache_memory,
                      enable_prefix_caching=False)  # fmt: skip
    configs: dict[str, dict | None] = {"none": None}
    for spec in args.ngram:
        k, low, high = map(int, spec.split(":"))
        configs[f"ngram k={k} n={low}..{high}"] = {
            "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": low,
            "prompt_lookup_max": high,
        }  # fmt: skip
    if args.draft:
        configs["draft_model k=4"] = {"method": "draft_model", "model": args.draft,
                                      "num_speculative_tokens": 4}  # fmt: skip
    if args.draft_layers:
        draft = early_exit_draft(model, args.draft_layers)
        configs[f"draft: {args.draft_layers} layers, k=4"] = {
            "method": "draft_model", "model": draft, "num_speculative_tokens": 4}  # fmt: skip
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"device": device, "model": model, "max_tokens": args.max_tokens, "runs": {}}
    for _ in range(args.rounds):
        for name, spec in configs.items():
            rows = run_config(model, spec, args.batch, args.max_tokens, args.groups, llm_kwargs)
            best = result["runs"].setdefault(name, rows)
            for i, row in enumerate(rows):
                if row["tok_per_s"] > best[i]["tok_per_s"]:
                    best[i] = row
    base = {r["batch"]: r for r in result["runs"]["none"]}
    print(f"{device}, {Path(model).name}, greedy, up to {args.max_tokens} tokens a request")
    for name, rows in result["runs"].items():
        for r in rows:
            r["ratio"] = r["tok_per_s"] / base[r["batch"]]["tok_per_s"]
            r["decode_ratio"] = r["decode_tok_per_s"] / base[r["batch"]]["decode_tok_per_s"]
            s = r.get("speculation")
            extra = (f", acceptance {s['acceptance_rate']:.2f}, mean accepted length "
                     f"{s['mean_accepted_length']:.2f}" if s else "")  # fmt: skip
            print(f"{name:22s} batch {r['batch']:3d}: {r['tok_per_s']:9.1f} tok/s = "
                  f"{r['ratio']:.2f}x; decode {r['decode_tok_per_s']:9.1f} tok/s = "
                  f"{r['decode_ratio']:.2f}x{extra}", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
