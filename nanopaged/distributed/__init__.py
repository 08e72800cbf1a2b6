"""Tensor parallelism: the rank's share of a model, its collectives, and the worker processes."""

from __future__ import annotations

import gc
import sys


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """Give back what dropped LLMs held (vLLM's name): collect garbage, return cached CUDA
    memory, and, with shutdown_ray, stop a Ray runtime this process started. An LLM's
    tensor-parallel workers and process group end with the LLM itself (on del or shutdown())."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    ray = sys.modules.get("ray")
    if shutdown_ray and ray is not None and ray.is_initialized():
        ray.shutdown()
