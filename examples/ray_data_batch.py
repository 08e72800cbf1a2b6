"""Batch inference over a JSONL or Parquet file of prompts with Ray Data, one LLM per actor.

python examples/ray_data_batch.py --input prompts.jsonl --output out/ --model /models/Qwen3-8B \
    --concurrency 4 --tensor-parallel-size 2

Each input row needs a prompt column (--prompt-column): text, or a chat as a list of
{"role", "content"} messages. The output (Parquet, or JSONL with --output-format json) keeps
every input column and adds generated_text, generated_token_ids and finish_reason. On a Ray
cluster (ray start --head / ray start --address=...), run it on any node: the actors spread
over the cluster's GPUs.
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input", required=True, help="a .jsonl/.json or .parquet file or dir")
    parser.add_argument("--output", required=True, help="output directory")
    parser.add_argument("--output-format", choices=["parquet", "json"], default="parquet")
    parser.add_argument("--model", default=None, help="HF model dir or .gguf (default SmolLM2)")
    parser.add_argument("--prompt-column", default="prompt")
    parser.add_argument("--concurrency", type=int, default=1, help="LLM replicas (actors)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per replica")
    parser.add_argument("--batch-size", type=int, default=256, help="rows per LLM.generate")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-model-len", type=int, default=None)
    args = parser.parse_args(argv)

    import ray
    import torch

    from nanopaged.integrations.ray_data import NanopagedPredictor

    ray.init(ignore_reinit_error=True)
    if args.input.endswith(".parquet"):
        ds = ray.data.read_parquet(args.input)
    else:
        ds = ray.data.read_json(args.input)
    gpus = ray.cluster_resources().get("GPU", 0) > 0 or torch.cuda.is_available()
    ds = ds.map_batches(
        NanopagedPredictor,
        fn_constructor_kwargs=dict(
            model=args.model,
            prompt_column=args.prompt_column,
            sampling_params=dict(temperature=args.temperature, max_tokens=args.max_tokens),
            tensor_parallel_size=args.tensor_parallel_size,
            max_model_len=args.max_model_len,
        ),
        concurrency=args.concurrency,
        num_gpus=args.tensor_parallel_size if gpus else 0,
        batch_size=args.batch_size,
    )
    if args.output_format == "parquet":
        ds.write_parquet(args.output)
    else:
        ds.write_json(args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
