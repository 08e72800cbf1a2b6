"""The draft-model proposer: a second, smaller model with the target's vocabulary proposes the
next k tokens of each speculating row greedily, from its own paged KV cache.

The draft runs on a second ModelRunner (same loader, device and dtype as the target; its K/V in
the run dtype, never 8-bit) whose blocks a BlockManager of its own hands out, prefix caching
off. Each sequence the draft serves has a shadow Sequence here (same tokens, its own block
table), keyed by the target's seq_id. A propose call, for the rows the Scheduler lets speculate:

1. Sync: the draft's K/V stays valid for the longest prefix its tokens share with the target's
   (the prompt and accepted tokens; the drafts the target rejected roll back, their blocks
   trimmed as the target's are). Only the positions past the last call's tokens are compared.
2. Catch up and draft 1: one forward over each row's tokens the draft has not seen (the whole
   prompt at first, after that the accepted drafts and the target's correction or bonus token),
   in chunks of at most max_num_batched_tokens, the last chunk's final position giving draft 1
   (on CUDA a pass whose tokens fit a decode graph replays it, each token a one-token row).
3. Drafts 2..k: one-token decode steps (replayed through the draft's decode graphs on CUDA).

Drafts are greedy (the argmax of the draft's logits), so their distribution q is one-hot: the
rejection sampler the n-gram drafts go through (sampling/rejection.py) is exact for them too,
for greedy and sampled targets alike.

Preemption: the Scheduler frees a preempted sequence's draft state with its blocks, so the
draft recomputes it when the target does. A row whose K/V the draft's cache cannot hold gets
no drafts this step (drafts never preempt).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from nanopaged.config import EngineConfig, ModelConfig
from nanopaged.engine.block_manager import BlockManager
from nanopaged.engine.kv_cache import DEFAULT_CPU_KV_CACHE_MEMORY, kv_bytes_per_block
from nanopaged.engine.model_runner import ModelRunner
from nanopaged.engine.sequence import Sequence
from nanopaged.engine.startup import resolve_model_dir
from nanopaged.engine.step_inputs import StepInputs, as_decode_rows, host_arrays
from nanopaged.sampling_params import SamplingParams
from nanopaged.spec.config import SpeculativeConfig

_NO_PAIRS: list[tuple[int, int]] = []


def _draft_config(spec: SpeculativeConfig, target: ModelConfig, max_model_len: int,
                  gguf_dtype: torch.dtype) -> tuple[Path, ModelConfig]:  # fmt: skip
    """The draft's directory and config, checked against the target's."""
    try:
        model_dir = resolve_model_dir(spec.model, gguf_dtype)
        config = ModelConfig.from_dir(model_dir, None, None)
    except (ValueError, OSError) as e:
        raise ValueError(f"speculative_config.model {spec.model!r}: {e}") from None
    if config.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model must share the target's vocabulary "
            f"({target.vocab_size} tokens), got a draft of {config.vocab_size}"
        )
    if config.max_position_embeddings < max_model_len:
        raise ValueError(
            f"speculative_config.model holds {config.max_position_embeddings} positions, fewer "
            f"than max_model_len ({max_model_len}); lower max_model_len"
        )
    return model_dir, config


def split_kv_budget(
    config: EngineConfig, gpu: bool, target_bytes_per_block: int, draft_bytes_per_block: int
) -> tuple[int, int]:
    """(the target's, the draft's) bytes of the KV budget, shared so both caches hold the same
    number of tokens (the draft holds every running sequence the target does, plus k - 1)."""
    budget = config.kv_cache_memory
    if budget is None:
        if gpu:
            # The target's profiled budget takes what the GPU has left; the draft's share of
            # it would have to be known before the profile runs.
            raise ValueError(
                "speculative_config method 'draft_model' on a GPU needs kv_cache_memory "
                "(bytes both KV caches share); set kv_cache_memory"
            )
        budget = DEFAULT_CPU_KV_CACHE_MEMORY
    total = target_bytes_per_block + draft_bytes_per_block
    target = budget * target_bytes_per_block // total
    return target, budget - target


class DraftProposer:
    """Proposes up to k next tokens per sequence with a draft model (see the module docstring)."""

    def __init__(self, runner: ModelRunner, num_speculative_tokens: int) -> None:
        self.runner = runner
        self.k = num_speculative_tokens
        self.block_manager = BlockManager(runner.num_blocks, runner.block_size, False, 0)
        self.max_num_batched_tokens = runner.config.max_num_batched_tokens
        self._params = SamplingParams(temperature=0)
        # target seq_id -> (the draft's shadow sequence, the target's length at its last call:
        # the positions before it are known to hold the target's tokens)
        self._seqs: dict[int, tuple[Sequence, int]] = {}

    @classmethod
    def start(
        cls, spec: SpeculativeConfig, config: EngineConfig, target: ModelConfig,
        max_model_len: int, device: torch.device, dtype: torch.dtype, gpu: bool,
        target_kv_dtype: torch.dtype, load_format: str,
    ) -> tuple[DraftProposer, EngineConfig]:  # fmt: skip
        """Load the draft on the target's device and dtype with its share of the KV budget;
        returns it and the target's EngineConfig (kv_cache_memory: the target's share)."""
        assert spec.method == "draft_model", spec.method
        model_dir, draft_config = _draft_config(spec, target, max_model_len, dtype)
        bs = config.block_size
        target_bytes, draft_bytes = split_kv_budget(
            config, gpu, kv_bytes_per_block(target, bs, target_kv_dtype),
            kv_bytes_per_block(draft_config, bs, dtype),
        )  # fmt: skip
        draft_engine = dataclasses.replace(
            config, kv_cache_memory=draft_bytes, speculative_config=None, kv_cache_dtype="auto",
            calculate_kv_scales=False,
        )  # fmt: skip
        runner = ModelRunner(model_dir, draft_config, draft_engine, max_model_len, device, dtype,
                             load_format)  # fmt: skip
        proposer = cls(runner, spec.num_speculative_tokens)
        return proposer, dataclasses.replace(config, kv_cache_memory=target_bytes)

    # ---- the proposer interface (Scheduler.Proposer) -------------------------------------
    def propose(self, seqs_tokens: list[list[int]], seq_ids: list[int]) -> list[list[int]]:
        """Each sequence's k greedy drafts from its token ids (prompt + output), or none where
        the draft's cache has no room for it."""
        assert len(seq_ids) == len(seqs_tokens), (len(seq_ids), len(seqs_tokens))
        rows: list[int] = []
        seqs: list[Sequence] = []
        for i, (tokens, seq_id) in enumerate(zip(seqs_tokens, seq_ids)):
            seq = self._sync(seq_id, tokens)
            if seq is not None:
                rows.append(i)
                seqs.append(seq)
        out: list[list[int]] = [[] for _ in seqs_tokens]
        if not seqs:
            return out
        drafts = self._draft(seqs)
        for i, d in zip(rows, drafts):
            out[i] = d
        return out

    def free(self, seq_id: int) -> None:
        """Drop a sequence's draft K/V (it finished, left, or was preempted); no-op if none."""
        entry = self._seqs.pop(seq_id, None)
        if entry is not None:
            self.block_manager.free(entry[0])

    def free_all(self) -> None:
        """Drop every sequence's draft K/V (after a failed step)."""
        for seq_id in list(self._seqs):
            self.free(seq_id)

    # ---- one call ------------------------------------------------------------------------
    def _sync(self, seq_id: int, tokens: list[int]) -> Sequence | None:
        """The shadow of seq_id holding tokens, its valid K/V kept and room taken for this
        call's k passes; None (state dropped) when the draft's cache is full."""
        entry = self._seqs.get(seq_id)
        if entry is None or entry[1] > len(tokens):
            self.free(seq_id)
            seq = Sequence(tokens, self._params)
            valid = 0
        else:
            seq, valid = entry
            # Past the previous call's tokens, the K/V holds that call's drafts: valid while
            # they equal the tokens the target accepted. At least the last token is input.
            limit = min(seq.num_computed_tokens, len(tokens) - 1)
            valid = min(valid, limit)
            while valid < limit and seq.token_ids[valid] == tokens[valid]:
                valid += 1
        # tokens[:valid] are already there: only the tail is replaced.
        del seq.token_ids[valid:]
        seq.token_ids.extend(tokens[valid:])
        seq.num_computed_tokens = valid
        bm = self.block_manager
        bm.trim(seq, valid)
        if not bm.append_slots(seq, len(tokens) - valid + self.k - 1):
            bm.free(seq)
            self._seqs.pop(seq_id, None)
            return None
        self._seqs[seq_id] = (seq, len(tokens))
        return seq

    def _draft(self, seqs: list[Sequence]) -> list[list[int]]:
        """Catch each shadow up on its tokens, then run k greedy passes; returns the drafts."""
        # Chunks before the last leave each row's final token for the pass that drafts.
        while sum(len(s) - s.num_computed_tokens for s in seqs) > self.max_num_batched_tokens:
            budget = self.max_num_batched_tokens
            work = []
            for seq in seqs:
                n = min(len(seq) - 1 - seq.num_computed_tokens, budget)
                budget -= n
                work.append(n)
            if not any(work):
                break  # one token a row left: the drafting pass takes them all
            self._forward(seqs, work, want_logits=False)
        drafts: list[list[int]] = [[] for _ in seqs]
        counts = [len(s) - s.num_computed_tokens for s in seqs]
        for j in range(self.k):
            ids = self._forward(seqs, counts, want_logits=True)
            for d, token in zip(drafts, ids):
                d.append(token)
            if j + 1 < self.k:
                for seq, token in zip(seqs, ids):
                    seq.token_ids.append(token)
                counts = [1] * len(seqs)
        return drafts

    @torch.inference_mode()
    def _forward(self, seqs: list[Sequence], counts: list[int], want_logits: bool) -> list[int]:
        """Compute counts[i] tokens of seqs[i] past its computed ones (rows with 0 skipped);
        with want_logits, the argmax token at each row's last position."""
        live = [(s, n) for s, n in zip(seqs, counts) if n > 0]
        starts = [s.num_computed_tokens for s, _ in live]
        num_scheduled = [n for _, n in live]
        width = max(len(s.block_table) for s, _ in live)
        tables = np.zeros((len(live), width), dtype=np.int32)
        input_ids: list[int] = []
        for i, (s, n) in enumerate(live):
            tables[i, : len(s.block_table)] = s.block_table
            input_ids.extend(s.token_ids[s.num_computed_tokens : s.num_computed_tokens + n])
        host = host_arrays(num_scheduled, starts, tables, self.runner.block_size)
        cu = host["cu_seqlens_q"]
        logits_indices = (cu[1:] - 1).astype(np.int64) if want_logits else np.zeros(0, np.int64)
        empty = np.zeros(0, dtype=np.int64)
        step = StepInputs(
            input_ids=np.asarray(input_ids, dtype=np.int64), positions=host["positions"],
            slots=host["slots"], tables=tables, context_lens=host["context_lens"],
            cu_seqlens_q=cu, logits_indices=logits_indices, blocks_to_swap_out=_NO_PAIRS,
            blocks_to_swap_in=_NO_PAIRS, blocks_to_copy=_NO_PAIRS, pending_dst=empty,
            pending_src=empty,
        )  # fmt: skip
        graphs = self.runner.graphs
        if graphs is not None and graphs.can_run(len(input_ids)):
            step = as_decode_rows(step)  # a catch-up of a few tokens a row: a graph replay
        logits, _ = self.runner.execute(step, None)
        for s, n in live:
            s.num_computed_tokens += n
        if not want_logits:
            return []
        # logits: [rows, vocab]
        return logits.argmax(dim=-1).tolist()
