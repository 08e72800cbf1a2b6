"""Sizing the paged KV cache, and the per-layer scales of an 8-bit one.

On a GPU the cache gets what gpu_memory_utilization leaves after the weights, the peak of the
largest step (profiled: a full prefill with its prompt-logprob chunk and its sampling) and
what the decode graphs will hold; on a CPU a byte budget (kv_cache_memory, 1 GiB by default).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from nanopaged.config import ModelConfig
from nanopaged.sampling.ops import sample, with_path
from nanopaged.sampling.prompt_logprobs import PROFILE_TOPK, rows_per_chunk, score_prompt_rows

if TYPE_CHECKING:
    from torch import nn

    from nanopaged.attention import Attention, AttentionMetadata
    from nanopaged.config import EngineConfig
    from nanopaged.distributed.parallel import TensorParallel
    from nanopaged.sampling.sampler import Sampler

# KV budget on CPU when kv_cache_memory is not given.
DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30
# Graph capture takes workspaces and allocator slack beyond the activations it profiles.
GRAPH_MARGIN = 256 << 20


def kv_bytes_per_block(
    model_config: ModelConfig, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None
) -> int:
    """Bytes of one KV block: K and V of block_size tokens in every layer (of num_kv_heads
    heads: a tensor-parallel rank's share; all of the model's by default)."""
    c = model_config
    elem = torch.empty((), dtype=dtype).element_size()
    heads = c.num_kv_heads if num_kv_heads is None else num_kv_heads
    return 2 * c.num_layers * block_size * heads * c.head_dim * elem


def blocks_for_budget(
    budget: int, bytes_per_block: int, block_size: int, max_model_len: int, max_num_seqs: int,
    knobs: str = "kv_cache_memory",
) -> int:  # fmt: skip
    """KV blocks that fit budget bytes; ValueError (naming knobs) when not one sequence of
    max_model_len fits. More blocks than every sequence at full length could use is waste."""
    num_blocks = budget // bytes_per_block
    blocks_per_seq = -(-max_model_len // block_size)
    if num_blocks < blocks_per_seq:
        raise ValueError(
            f"the KV cache holds {num_blocks * block_size} tokens "
            f"({budget / 2**20:.1f} MiB at {bytes_per_block} bytes per block of "
            f"{block_size}), less than one sequence of max_model_len={max_model_len}; raise "
            f"{knobs}, or lower max_model_len"
        )
    return min(num_blocks, blocks_per_seq * max_num_seqs)


def kv_scales(
    layers: list[Attention], device: torch.device, checkpoint: dict[int, dict[str, float]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """An 8-bit cache's scales ([2, num_layers] fp32: K and V of each layer; the cache holds
    x / scale) and peaks ([2, num_layers]: the first pass's largest |K| / k_scale and
    |V| / v_scale), bound to each layer as views.

    Scales are 1.0 unless the checkpoint has its own, or calculate_kv_scales sets them from
    the first forward pass. Measured on SmolLM2, scales calibrated from activations agreed no
    better with full precision than 1.0 (benchmarks/fp8_accuracy.py); they matter for K/V
    beyond the format's range. The kernels read them from the device, so CUDA graphs follow
    any later change. Under tensor parallelism each rank holds its own."""
    scales = torch.ones(2, len(layers), dtype=torch.float32, device=device)
    peaks = torch.zeros(2, len(layers), dtype=torch.float32, device=device)
    for i, parts in checkpoint.items():
        for row, part in enumerate("kv"):
            if part in parts:
                scales[row, i] = parts[part]
    for i, layer in enumerate(layers):
        layer.k_scale = scales[0, i : i + 1]
        layer.v_scale = scales[1, i : i + 1]
        layer.kv_peak = peaks[:, i]
    return scales, peaks


def warn_past_kv_range(peaks: torch.Tensor, dtype: torch.dtype) -> None:
    """After the first forward pass over an 8-bit cache with fixed scales: warn, once, when
    some layer's K or V passed the format's largest value (store_kv clamps them). Reads the
    peaks back: one host sync, on this step only."""
    fmax = torch.finfo(dtype).max
    peaks = peaks.cpu()
    past = [f"layer {i} {'KV'[row]} {peaks[row, i].item():.4g}"
            for i, row in sorted((i, row) for row, i in (peaks > fmax).nonzero().tolist())]
    if past:
        name = str(dtype).removeprefix("torch.")
        warnings.warn(
            f"the first forward pass stored K/V past {name}'s largest value ({fmax:g}) at "
            f"their scales ({', '.join(past[:4])}{', ...' if len(past) > 4 else ''}): they "
            "are clamped. Use calculate_kv_scales=True, or a checkpoint with KV scales.",
            stacklevel=3,
        )


class ModelRunner(Protocol):
    """What the memory profile reads of the runner being built (engine/model_runner.py)."""

    config: EngineConfig
    model_config: ModelConfig
    model: nn.Module
    sampler: Sampler
    tp: TensorParallel
    attention_layers: list[Attention]
    device: torch.device
    kv_cache_dtype: torch.dtype
    max_model_len: int
    block_size: int
    num_kv_heads: int

    def bind_kv(self, cache: torch.Tensor) -> None: ...
    def _metadata(
        self, num_scheduled: list[int], starts: list[int], block_tables: list[list[int]]
    ) -> tuple[torch.Tensor, AttentionMetadata]: ...


def profile_cuda_budget(runner: ModelRunner) -> int:
    """Bytes left for KV under the utilization cap after the weights, the peak of a full
    prefill step with its prompt-logprob chunk and its sampling (every sampling option on),
    and what CUDA graphs of decode steps will hold."""
    cfg = runner.config
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    # The largest step: max_num_batched_tokens, in sequences of at most max_model_len.
    total = cfg.max_num_batched_tokens
    lens = [runner.max_model_len] * (total // runner.max_model_len)
    if total % runner.max_model_len:
        lens.append(total % runner.max_model_len)
    blocks = [-(-n // runner.block_size) for n in lens]
    c = runner.model_config
    scratch = torch.empty(
        2, c.num_layers, sum(blocks), runner.block_size, runner.num_kv_heads, c.head_dim,
        dtype=runner.kv_cache_dtype, device=runner.device,
    )  # fmt: skip
    runner.bind_kv(scratch)
    firsts = np.cumsum([0] + blocks[:-1])
    tables = [list(range(f, f + b)) for f, b in zip(firsts, blocks)]
    with torch.inference_mode():
        _profile_prefill(runner, lens, tables)
        graph_bytes = 0 if cfg.enforce_eager else _profile_decode(runner, blocks, tables)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - scratch.numel() * scratch.element_size()
    del scratch
    for layer in runner.attention_layers:
        layer.k_cache = layer.v_cache = None
    torch.cuda.empty_cache()
    free, total_bytes = torch.cuda.mem_get_info()
    not_torch = total_bytes - free - torch.cuda.memory_reserved()
    budget = int(total_bytes * cfg.gpu_memory_utilization)
    return max(0, budget - peak - graph_bytes - not_torch - GRAPH_MARGIN)


def _profile_prefill(runner: ModelRunner, lens: list[int], tables: list[list[int]]) -> None:
    """The largest prefill step, a chunk of its prompt rows scored for prompt_logprobs, and
    its rows sampled with every option on."""
    total = sum(lens)
    positions, meta = runner._metadata(lens, [0] * len(lens), tables)
    input_ids = torch.zeros(total, dtype=torch.long, device=runner.device)
    rows = min(runner.config.max_num_seqs, total)
    vocab = runner.model_config.vocab_size
    hidden = runner.model(input_ids, positions, meta)
    probe = np.arange(min(total, rows_per_chunk(vocab, PROFILE_TOPK)))
    score_prompt_rows(runner.model.compute_logits, hidden, probe, np.zeros_like(probe),
                      np.full_like(probe, PROFILE_TOPK), vocab)  # fmt: skip
    logits = runner.model.compute_logits(hidden[:rows])  # None on ranks other than 0
    if logits is not None:
        runner.sampler.profile(logits.float())


def _profile_decode(runner: ModelRunner, blocks: list[int], tables: list[list[int]]) -> int:
    """Bytes a decode forward at max_num_seqs allocates: the activations the graphs' pool
    keeps (with the captured samplers' logits and scratch on one GPU)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    n = runner.config.max_num_seqs
    starts = [min(b * runner.block_size, runner.max_model_len) - 1 for b in blocks]
    positions, meta = runner._metadata([1] * n, (starts * n)[:n], (tables * n)[:n])
    ids = torch.zeros(n, dtype=torch.long, device=runner.device)
    hidden = runner.model(ids, positions, meta)
    if runner.tp.size == 1:
        logits = runner.model.compute_logits(hidden)
        st = runner.sampler.profile(logits, num_logprobs=0)
        sample(logits, with_path(st, "frontier"))
        del logits
    del hidden
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before
