"""KV memory figures of the vLLM paper, replicated: Fig. 2 (slot utilization), Fig. 15 (memory
saved by sharing for parallel sampling and beam search) and §6.4 (shared-prefix throughput).

python benchmarks/memory_bench.py [--json PATH] [--requests N] [--device cpu|cuda] [--model DIR]
(also: python bench.py --memory)

Utilization and sharing drive the engine's own Scheduler and BlockManager over synthetic
length distributions, with a stand-in for the model that returns random tokens (beams: random
candidate logprobs): memory use depends only on lengths and on which sequences share what,
so this measures exactly the engine's block accounting, at any scale, without a GPU. Lengths
are lognormal with the means of the paper's datasets (§6.1, Fig. 11): ShareGPT-like, input
161 / output 338 tokens, high variance; Alpaca-like, input 19 / output 58.
The prefix-caching throughput runs the real engine (a small random Llama when no --model is
given; on CPU unless --device cuda) with one few-shot prefix before every request, caching on
against off in the same process.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from pathlib import Path

import torch

from nanopaged.engine.block_manager import BlockManager
from nanopaged.engine.scheduler import Scheduler
from nanopaged.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from nanopaged.sampling.output import SampleOutput
from nanopaged.sampling_params import BeamSearchParams, SamplingParams

# (input mean, output mean, sigma of log-length): the paper's dataset means.
DATASETS = {
    "sharegpt": (161.31, 337.99, 1.0),
    "alpaca": (19.31, 58.45, 0.6),
}
VOCAB = 32000


def lengths(dataset: str, num: int, seed: int = 0) -> list[tuple[int, int]]:
    """(input, output) lengths, lognormal with the dataset's means, clipped to [1, 1024]."""
    mean_in, mean_out, sigma = DATASETS[dataset]
    rng = random.Random(seed)

    def draw(mean: float) -> int:
        mu = math.log(mean) - sigma**2 / 2  # so that the lognormal's mean is `mean`
        return max(1, min(1024, round(rng.lognormvariate(mu, sigma))))

    return [(draw(mean_in), draw(mean_out)) for _ in range(num)]


def simulate(
    reqs: list[tuple[int, int]],
    *,
    block_size: int = 16,
    num_blocks: int = 1000,
    n: int = 1,
    beam_width: int = 0,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 4096,
    seed: int = 0,
) -> dict:
    """Run the scheduler over reqs with a stand-in model; time-averaged KV figures.

    utilization: token slots holding a token / slots of the used blocks. saving: 1 - physical
    blocks used / blocks the same sequences would hold without sharing (sum of table lengths).
    Both are ratios of sums over steps, sampled after every step.
    """
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs, max_num_batched_tokens, 4096)
    for i, (inp, out) in enumerate(reqs):
        prompt = [rng.randrange(VOCAB) for _ in range(inp)]
        if beam_width:
            params = SamplingParams(max_tokens=out, ignore_eos=True)
            beam = BeamSearchParams(beam_width=beam_width, max_tokens=out, ignore_eos=True)
            group = SequenceGroup(str(i), Sequence(prompt, params, str(i)), beam_params=beam)
        else:
            params = SamplingParams(n=n, max_tokens=out, ignore_eos=True)
            group = SequenceGroup(str(i), Sequence(prompt, params, str(i)))
        sched.add(group)
    stored = slots = physical = logical = steps = 0
    while sched.has_unfinished():
        batch = sched.schedule()
        assert batch.seqs, "no progress"
        outs = _stand_in_outputs(batch, rng)
        sched.advance(batch)
        sched.commit(batch, outs)
        running = [
            s for g in sched.running for s in g.seqs_with_status(SequenceStatus.RUNNING)
        ]
        stats = bm.kv_stats(running)
        used = stats.num_used_blocks
        stored += stats.slot_utilization * used * block_size
        slots += used * block_size
        physical += used
        logical += sum(len(s.block_table) for s in running)
        steps += 1
    return {
        "utilization": stored / slots if slots else 1.0,
        "saving": 1 - physical / logical if logical else 0.0,
        "steps": steps,
        "preemptions": sched.num_preemptions,
        "peak_used_blocks": bm.peak_used_blocks,
    }


def _stand_in_outputs(batch, rng: random.Random) -> list:
    """What the runner would return, with random tokens: n for a forking parent, 2 * width
    candidates with descending random logprobs for a beam, one token otherwise."""
    outs = []
    for i, seq in enumerate(batch.seqs):
        if not batch.sampling[i]:
            continue
        group = seq.group
        if group.is_beam_search:
            k = 2 * group.beam_params.beam_width
            logprobs = sorted((-rng.expovariate(1.0) for _ in range(k)), reverse=True)
            outs.append(SampleOutput(rng.sample(range(VOCAB), k), logprobs))
        elif not group.forked:
            outs.append(SampleOutput([rng.randrange(VOCAB) for _ in range(group.num_samples)]))
        else:
            outs.append(rng.randrange(VOCAB))
    return outs


# ---- shared-prefix throughput (the real engine) ---------------------------------------------
def small_model(path: Path) -> Path:
    """A random Llama big enough that prefill compute, not Python, dominates a CPU step."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def prefix_throughput(
    model_dir: Path, device: str, num_requests: int, prefix_len: int, rounds: int = 3
) -> dict:
    """Requests = one shared few-shot prefix + a short suffix; prefix caching on vs off.

    Both engines live in one process and take turns on the same requests, `rounds` times with
    fresh suffixes each round (so only the prefix can hit); each keeps its best round. The
    prefix is cached beforehand, as the paper's is.
    """
    from nanopaged import LLM

    rng = random.Random(prefix_len)
    prefix = [rng.randrange(VOCAB) for _ in range(prefix_len)]
    # Two engines share the device: a fixed KV budget each (ample for the workload on a GPU).
    kv_bytes = 8 << 30 if device == "cuda" else 1 << 30
    engines = {}
    for caching in (False, True):
        engines[caching] = LLM(str(model_dir), device=device, enable_prefix_caching=caching,
                               kv_cache_memory=kv_bytes, max_model_len=1024)  # fmt: skip
        engines[caching].generate([prefix + [1]], SamplingParams(max_tokens=2), use_tqdm=False)
    best: dict[bool, tuple[float, int, int]] = {}
    for _ in range(rounds):
        prompts = [
            prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(20, 60))]
            for _ in range(num_requests)
        ]
        params = [
            SamplingParams(temperature=0, ignore_eos=True, max_tokens=rng.randint(20, 60))
            for _ in range(num_requests)
        ]
        for caching, llm in engines.items():
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            if device == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            cached = sum(o.num_cached_tokens for o in outs)
            if caching not in best or seconds < best[caching][0]:
                best[caching] = (seconds, tokens, cached)
    result = {}
    for caching, (seconds, tokens, cached) in best.items():
        key = "on" if caching else "off"
        result[f"{key}_seconds"] = seconds
        result[f"{key}_req_per_s"] = num_requests / seconds
        result[f"{key}_tok_per_s"] = tokens / seconds
        result[f"{key}_cached_tokens"] = cached
    result["speedup"] = result["on_req_per_s"] / result["off_req_per_s"]
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--json", default=None, help="write every figure here")
    parser.add_argument("--requests", type=int, default=400, help="requests, utilization runs")
    parser.add_argument("--sharing-requests", type=int, default=150)
    parser.add_argument("--num-blocks", type=int, default=1000, help="KV blocks of 16 tokens")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default=None, help="model for the prefix workload")
    parser.add_argument("--prefix-requests", type=int, default=None)
    parser.add_argument("--skip-prefix", action="store_true", help="simulations only")
    parser.add_argument("--prefix-only", action="store_true", help="the prefix workload only")
    args = parser.parse_args(argv)
    out: dict = {"device": args.device}
    if not args.prefix_only:
        simulations(args, out)
    if not args.skip_prefix:
        prefix_workloads(args, out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


def simulations(args: argparse.Namespace, out: dict) -> None:
    print("Fig. 2: KV slot utilization (token slots holding a token / slots of used blocks)")
    out["utilization"] = {}
    for ds in DATASETS:
        reqs = lengths(ds, args.requests)
        for bs in (8, 16, 32):
            num_blocks = args.num_blocks * 16 // bs  # the same memory at every block size
            r = simulate(reqs, block_size=bs, num_blocks=num_blocks)
            out["utilization"][f"{ds}/bs{bs}"] = r
            print(f"  {ds:8s} block {bs:2d}: {100 * r['utilization']:.1f}% "
                  f"({r['preemptions']} preemptions)")  # fmt: skip

    # Memory enough that nothing is preempted: a recomputed group shares only its full blocks.
    print("Fig. 15: memory saved by sharing (1 - physical blocks / blocks without sharing)")
    out["sharing"] = {}
    for ds in DATASETS:
        reqs = lengths(ds, args.sharing_requests, seed=1)
        for kind in ("n", "beam"):
            row = []
            for k in range(2, 7):
                kw = {"n": k} if kind == "n" else {"beam_width": k}
                r = simulate(reqs, **kw, num_blocks=args.num_blocks * 16)
                out["sharing"][f"{ds}/{kind}{k}"] = r
                row.append(f"{k}: {100 * r['saving']:.1f}%" + ("*" if r["preemptions"] else ""))
            label = "parallel n" if kind == "n" else "beam width"
            print(f"  {ds:8s} {label}  " + "  ".join(row))
    print("  (* = some groups were preempted, which gives up their sharing)")


def prefix_workloads(args: argparse.Namespace, out: dict) -> None:
    num = args.prefix_requests or (16 if args.device == "cpu" else 256)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else small_model(Path(tmp) / "llama")
        out["prefix"] = {}
        for shots, prefix_len in (("1-shot", 80), ("5-shot", 341)):
            r = prefix_throughput(model, args.device, num, prefix_len)
            out["prefix"][shots] = r
            print(
                f"§6.4 shared prefix ({shots}, {prefix_len} tokens, {num} requests, "
                f"{args.device}, {'given model' if args.model else 'small random Llama'}): "
                f"caching off {r['off_req_per_s']:.2f} req/s, on {r['on_req_per_s']:.2f} "
                f"req/s = {r['speedup']:.2f}x"
            )


if __name__ == "__main__":
    main()
