"""The step metadata every attention backend shares; each backend adds its own fields in a
subclass, made by its prepare_metadata."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Everything attention needs to find a batch's tokens in the paged KV cache."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not store
    block_tables: torch.Tensor  # [batch, max_blocks] int32
    context_lens: torch.Tensor  # [batch] int32, tokens in cache after this step
    cu_seqlens_q: torch.Tensor  # [batch + 1] int32
    max_seqlen_q: int
    max_context_len: int
    # An 8-bit cache's first forward pass (ModelRunner.first_kv_pass), before storing:
    # "calculate": each layer sets its K and V scales from this step's K/V
    # (store_kv.calibrated_scale); "check": it records their largest |K| / k_scale and
    # |V| / v_scale in kv_peak.
    first_kv_pass: str | None = None

    @property
    def is_decode(self) -> bool:
        return self.max_seqlen_q == 1
