"""Prompt logprobs by a teacher-forced forward of the whole prompt beside the step loop.

The step loop keeps only the last position's logits, and a prefix-cache hit skips the prompt
positions altogether; a request asking for prompt_logprobs is instead run once more here, in
one eager forward over a scratch KV cache, so the scheduler and the cache never know of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nanopaged.engine.model_runner import ModelRunner

# Logits rows turned into logprobs at a time: a [rows, vocab] fp32 block stays small.
_ROWS_PER_CHUNK = 256


@torch.inference_mode()
def compute_prompt_logprobs(
    runner: ModelRunner, token_ids: list[int], num_logprobs: int
) -> tuple[list[dict[int, float]], list[dict[int, int]]]:
    """For prompt tokens 1..len-1: the top-num_logprobs logprobs of their position plus the
    token's own, and each listed token's 1-based rank (the first token has no entry)."""
    c = runner.model_config
    n, bs, dev = len(token_ids), runner.block_size, runner.device
    num_blocks = -(-n // bs)
    # scratch: [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]
    scratch = torch.empty(
        2, c.num_layers, num_blocks, bs, c.num_kv_heads, c.head_dim,
        dtype=runner.kv_cache.dtype, device=dev,
    )  # fmt: skip
    layers = runner.attention_layers
    saved = [(layer.k_cache, layer.v_cache) for layer in layers]
    try:
        runner.bind_kv(scratch)
        positions, meta = runner._metadata([n], [0], [list(range(num_blocks))])
        ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
        hidden = runner.model(ids, positions, meta)  # [n, hidden_size]
    finally:
        for layer, (k, v) in zip(layers, saved):
            layer.k_cache, layer.v_cache = k, v
        del scratch
    entries: list[dict[int, float]] = []
    ranks: list[dict[int, int]] = []
    k = min(num_logprobs, c.vocab_size)
    targets = ids[1:]
    for start in range(0, n - 1, _ROWS_PER_CHUNK):
        end = min(start + _ROWS_PER_CHUNK, n - 1)
        # lp: [end - start, vocab]; row j predicts prompt token j + 1
        lp = runner.model.compute_logits(hidden[start:end]).float().log_softmax(dim=-1)
        own = lp.gather(1, targets[start:end, None]).squeeze(1)
        own_rank = ((lp > own[:, None]).sum(dim=-1) + 1).tolist()
        top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
        own, top_v, top_i = own.tolist(), top_v.tolist(), top_i.tolist()
        for r in range(end - start):
            token = token_ids[start + r + 1]
            entry = dict(zip(top_i[r], top_v[r]))
            rank = {t: j + 1 for j, t in enumerate(top_i[r])}
            entry[token] = own[r]
            rank.setdefault(token, own_rank[r])
            entries.append(entry)
            ranks.append(rank)
    return entries, ranks
