"""Host cost of structured outputs' grammar masks per decode step (CPU; no model, no device).

python benchmarks/mask_bench.py [--rows 64 256] [--steps 120] [--fill-threads N] [--lanes N]
                                [--engine-ms 2]

bench.py's 152k-vocabulary tokenizer and its JSON schemas (bench_schema), one schema shared by
every request or one per request. A batch of `rows` requests decodes through the grammar:
each step every row's mask is filled (Sampler.token_mask: the fill, its row index and the copy's
launch) and each row takes a token its mask allows, drawn uniformly (the argmax of iid random
logits under the mask), then the matchers consume them (StructuredBackend.accept). A request
leaves at its max_tokens (100..400) or when its grammar is done, and a new one takes its row,
so lexer states are met for the first time throughout, as in a served batch. accept also
fills the next masks ahead (StructuredBackend.fill_ahead); the engine's own work between a
step's accept and the next token_mask (outputs, stop strings, scheduling) is stood in for by
--engine-ms of sleep. Prints per step the mean ms of token_mask (masks not filled ahead, and
the copy's launch), of every fill (ahead or now), and of consume (accept, its fill included).
--lanes 1: every request of one schema on one lexer (llguidance's copies of a matcher share
its lexer and its lock), as before lanes.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB = 151_936


@dataclass
class Row:
    """What Sampler.token_mask reads of a sequence."""

    matcher: object
    max_tokens: int
    num_tokens: int = 0
    is_finished: bool = False


def pick_tokens(bitmask: np.ndarray, eos: int, rng: random.Random) -> list[int]:
    """One allowed token per row of bitmask ([rows, words] uint32), uniformly; EOS only where
    nothing else is allowed."""
    tokens = []
    for row in bitmask:
        for _ in range(32):  # free text allows most ids: a few tries find one
            t = rng.randrange(VOCAB)
            if t != eos and (row[t >> 5] >> (t & 31)) & 1:
                break
        else:
            allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
            allowed = allowed[allowed < VOCAB]
            others = allowed[allowed != eos]
            t = int(rng.choice(list(others if len(others) else allowed)))
        tokens.append(t)
    return tokens


def run(backend, sampler, eos: int, rows: int, steps: int, mode: str, engine_s: float) -> dict:
    """Drive `rows` requests for `steps` steps; mean ms per step of each phase."""
    import bench
    from nanopaged.sampling_params import StructuredOutputsParams

    salt = f"{mode}{rows}{time.perf_counter_ns()}"  # compiles inside this run
    rng = random.Random(rows)
    served = 0

    def new_row() -> Row:
        nonlocal served
        schema = bench.bench_schema(0 if mode == "shared" else served, salt)
        served += 1
        compiled = backend.submit(StructuredOutputsParams(json=schema)).result()
        return Row(compiled.matcher(), rng.randint(100, 400))

    batch = [new_row() for _ in range(rows)]
    times: dict[str, list[float]] = {"token_mask": [], "consume": []}
    backend.stats.reset()
    fill, filled_now = backend.fill, []

    def timed_fill(*a, **k) -> None:
        started = time.perf_counter()
        fill(*a, **k)
        filled_now.append(time.perf_counter() - started)

    backend.fill = timed_fill  # fills ahead (in accept) and in masks()
    for _ in range(steps):
        t0 = time.perf_counter()
        mask = sampler.token_mask(batch)
        t1 = time.perf_counter()
        times["token_mask"].append(t1 - t0)
        words = mask.words.numpy().view(np.uint32)[mask.rows.numpy()]  # row i's mask
        tokens = pick_tokens(words, eos, rng)
        t2 = time.perf_counter()
        backend.accept([(r.matcher, [t]) for r, t in zip(batch, tokens)])
        times["consume"].append(time.perf_counter() - t2)
        for i, r in enumerate(batch):
            r.num_tokens += 1
            if r.num_tokens >= r.max_tokens or r.matcher.is_terminated():
                batch[i] = new_row()
        time.sleep(engine_s)
    result = {k: 1e3 * statistics.fmean(v) for k, v in times.items()}
    backend.fill = fill
    result["fill"] = 1e3 * sum(filled_now) / steps
    result["requests"] = served
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--fill-threads", type=int, default=None,
                        help="llguidance's fill threads (default: its own choice)")  # fmt: skip
    parser.add_argument("--engine-ms", type=float, default=2.0,
                        help="host work of the engine between accept and token_mask")  # fmt: skip
    parser.add_argument("--lanes", type=int, default=None,
                        help="lexers per grammar (default: one per fill thread)")  # fmt: skip
    args = parser.parse_args()

    from transformers import AutoTokenizer

    import bench
    from nanopaged.sampling.sampler import Sampler
    from nanopaged.structured import StructuredBackend

    path = Path(tempfile.gettempdir()) / "nanopaged-mask-bench-tokenizer"
    path.mkdir(exist_ok=True)
    bench.add_tokenizer(path, VOCAB)
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = tokenizer.eos_token_id
    backend = StructuredBackend(tokenizer, VOCAB, [eos], fill_threads=args.fill_threads)
    sampler = Sampler(VOCAB, torch.device("cpu"))
    sampler.structured = backend
    if args.lanes is not None:
        backend.compiler.num_lanes = args.lanes
    print(f"vocab {VOCAB}, {backend.filler.num_threads} fill threads, "
          f"{backend.compiler.num_lanes} lanes, {args.steps} steps, "
          f"engine {args.engine_ms} ms")  # fmt: skip
    for rows in args.rows:
        for mode in ("shared", "per row"):
            r = run(backend, sampler, eos, rows, args.steps, mode, args.engine_ms / 1e3)
            print(f"{rows:4d} rows  json schema ({mode:7s})  token_mask {r['token_mask']:7.3f} "
                  f"ms/step  (fills {r['fill']:7.3f})  consume {r['consume']:6.3f} "
                  f"ms/step  ({r['requests']} requests)",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
