"""Batch inference over a JSONL or Parquet file of prompts with Ray Data, one LLM per actor.

python examples/ray_data_batch.py --input prompts.jsonl --output out/ --model /models/Qwen3-8B \
    --concurrency 4 --tensor-parallel-size 2

Each input row needs a prompt column (--prompt-column): a chat as a list of {"role", "content"}
messages, rendered with the model's chat template, or text, sent as a raw completion (--chat
sends it as a user message instead, as instruct models expect). The output (Parquet, or JSONL
with --output-format json) keeps every input column and adds generated_text,
generated_token_ids and finish_reason. Each replica reserves what it runs: its GPUs on GPU
nodes, its torch threads (--num-threads) on CPU; more replicas than the cluster holds is an error
before anything loads (--wait-for-nodes: wait for an autoscaler instead). On a Ray cluster
(ray start --head / ray start --address=...), run it on any node: the replicas spread over it.
"""

from __future__ import annotations

import argparse
import os
import time


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="a .jsonl/.json or .parquet file or dir")
    parser.add_argument("--output", required=True, help="output directory")
    parser.add_argument("--output-format", choices=["parquet", "json"], default="parquet")
    parser.add_argument("--model", default=None, help="HF model dir or .gguf (default SmolLM2)")
    parser.add_argument("--prompt-column", default="prompt")
    parser.add_argument("--chat", action="store_true", help="apply the chat template to text")
    parser.add_argument("--concurrency", type=int, default=1, help="LLM replicas (actors)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per replica")
    parser.add_argument(
        "--num-threads", type=int, default=None,
        help="torch threads per replica on CPU (default: the cluster's CPUs over the replicas)",
    )  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=256, help="rows per LLM.generate")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--replica-column", default=None, help="add a column: host:pid of the replica per row"
    )
    parser.add_argument(
        "--wait-for-nodes", action="store_true",
        help="autoscaling cluster: log and wait when the replicas do not fit yet",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not os.path.exists(args.input):
        raise ValueError(f"--input {args.input} does not exist")

    import ray

    from nanopaged.integrations.ray_data import ClusterTooSmall, add_generations, io_args

    ray.init(ignore_reinit_error=True)
    start = time.perf_counter()
    # Reads and writes reserve no CPU, so they run when the replicas' threads hold every CPU.
    read = ray.data.read_parquet if args.input.endswith(".parquet") else ray.data.read_json
    ds = read(args.input, **io_args(read))
    try:
        ds = add_generations(
            ds,
            args.model,
            concurrency=args.concurrency,
            tensor_parallel_size=args.tensor_parallel_size,
            num_threads=args.num_threads,
            batch_size=args.batch_size,
            wait_for_nodes=args.wait_for_nodes,
            prompt_column=args.prompt_column,
            chat=args.chat,
            replica_column=args.replica_column,
            sampling_params=dict(temperature=args.temperature, max_tokens=args.max_tokens),
            max_model_len=args.max_model_len,
        )
    except ClusterTooSmall as e:
        raise ValueError(f"--concurrency {args.concurrency} is more than Ray holds: {e}") from None
    write = ds.write_parquet if args.output_format == "parquet" else ds.write_json
    write(args.output, **io_args(write))
    print(f"wrote {args.output} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
