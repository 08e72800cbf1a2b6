"""The Sampler: logits rows in, token ids out, for every step of one model on rank 0.

It holds the sampling state that lives across steps on the device (each row's settings while
the same sequences keep sampling, penalty counts) and turns a step's logits into a StepHandle
by the path the step's rows need (StepRows): the fused kernel for plain rows (with their raw
logprobs in the same pass), the host path for forks, beams and logit controls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from nanopaged.platform import pinned, platform_of
from nanopaged.sampling.host import sample_sequences
from nanopaged.sampling.ops import (
    SAMPLER_PATHS,
    SamplingTensors,
    SlotSettings,
    TokenMask,
    sample,
    sampling_tensors,
    with_path,
)
from nanopaged.sampling.output import DeviceSamples, GraphSampler, StepHandle
from nanopaged.sampling.penalties import PenaltyCounts, mask_early_stops, penalize
from nanopaged.sampling.rows import StepRows, row_stream
from nanopaged.sampling.speculative import DraftStepHandle, verify_drafts

if TYPE_CHECKING:
    from nanopaged.engine.sequence import Sequence
    from nanopaged.structured import StructuredBackend


class Sampler:
    """Samples the logits rows of one model's steps (see the module's docstring)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        # Penalized sequences' token counts, kept on the device across steps (made on first use).
        self.penalty_counts: PenaltyCounts | None = None
        # (the sequences' ids and whether in slots, their settings, their offsets) of the last
        # step that sampled on the device: the next step with the same sequences reuses them.
        self._cache: tuple[tuple, SamplingTensors, list[int]] | None = None
        # Structured outputs: the grammars' backend (set by the engine when the first
        # constrained request joins), which holds the host rows their masks are filled into.
        self.structured: StructuredBackend | None = None
        self._masks_copied: torch.cuda.Event | None = None  # the last copy of host masks

    @staticmethod
    def rows(seqs: list[Sequence], speculating: bool = False) -> StepRows:
        """What the step's sampled rows need together: the one place it is derived
        (speculating: the step runs in speculation mode, ScheduledBatch.speculating)."""
        return StepRows.of(seqs, speculating)

    def settings(self, seqs: list[Sequence], into: SlotSettings | None = None) -> SamplingTensors:
        """Per-row settings, kept on the device while consecutive steps sample the same
        sequences: then each row's offset (its output position) just moves on by one, on the
        device, with no copy from the host. into: in the decode graphs' persistent settings."""
        offsets = [s.num_output_tokens for s in seqs]
        key = (tuple(s.seq_id for s in seqs), into is not None)
        if self._cache is not None and self._cache[0] == key:
            _, st, last = self._cache
            if not st.all_greedy and offsets != last:
                if all(o == p + 1 for o, p in zip(offsets, last)):
                    st.offsets.add_(1)
                else:
                    host = pinned(torch.tensor(offsets, dtype=torch.int64))
                    st.offsets.copy_(host, non_blocking=True)
            self._cache = (key, st, offsets)
            return st
        params = [s.sampling_params for s in seqs]
        classes = [s.row for s in seqs]
        streams = [row_stream(s) for s in seqs]
        st = sampling_tensors(params, streams, offsets, self.device, into, classes)
        self._cache = (key, st, offsets)
        return st

    def draft_settings(self, seqs: list[Sequence], drafts: list[list[int]],
                       into: SlotSettings) -> SamplingTensors:  # fmt: skip
        """Settings of a step with drafts sampled in the decode graph: a row per verified
        position, row i's settings at output positions offset_i + j for j = 0 .. d_i (the
        plain sampler's draw there is what verification keeps, DraftStepHandle.of_draws)."""
        counts = [len(d) + 1 for d in drafts]
        offsets = [s.num_output_tokens + j for s, c in zip(seqs, counts) for j in range(c)]
        # Kept as settings() keeps its own (the keys differ: either step rewrites the slots).
        # Greedy rows' settings are all alike: only how many there are matters.
        greedy = all(s.row.greedy for s in seqs)
        key = (tuple(s.seq_id for s in seqs), sum(counts) if greedy else tuple(counts))
        if self._cache is not None and self._cache[0] == key:
            _, st, last = self._cache
            if not st.all_greedy and offsets != last:
                host = pinned(torch.tensor(offsets, dtype=torch.int64))
                st.offsets.copy_(host, non_blocking=True)
        else:
            per = [s for s, c in zip(seqs, counts) for _ in range(c)]
            st = sampling_tensors([s.sampling_params for s in per], [row_stream(s) for s in per],
                                  offsets, self.device, into, [s.row for s in per])  # fmt: skip
        self._cache = (key, st, offsets)
        return st

    def sample(
        self,
        logits: torch.Tensor | DeviceSamples | None,
        seqs: list[Sequence],
        rows: StepRows,
        pending: torch.Tensor | None,
        eos_token_ids: set[int],
        drafts: list[list[int]] | None = None,
    ) -> StepHandle:
        """The step's samples from its logits rows ([len(seqs), vocab]; or its tokens, sampled
        already in the decode graph or in shards; None: nothing samples). pending: the previous
        step's sampled tokens on the device; drafts: each row's draft tokens, when the step
        speculates (sample_drafts).

        Every path brings back with each row's token whether finite logits decided it (its
        sampled logit: DeviceSamples; SampleOutput.finite), checked where the step's samples
        are read (StepHandle.result).

        Rows with a grammar defer the sampling (StepHandle.deferred): their masks need each
        matcher past the previous step's token, which may still be on the device while this
        step's forward pass is queued (asynchronous scheduling). The engine runs the sampler
        once the matchers took it (StepHandle.sampled). On the device path all that reads the
        sequences' token counts runs now (_on_device): the engine may advance them to the
        next step before it samples this one."""
        if drafts is not None:
            return self.sample_drafts(logits, seqs, rows, drafts, eos_token_ids)
        if not rows.constrained:
            return self._sample(logits, seqs, rows, pending, eos_token_ids)
        if isinstance(logits, GraphSampler):  # the decode graph's, its settings written
            handle = StepHandle.deferred(lambda: self._finish(self._replay(logits, seqs), seqs,
                                                              rows))  # fmt: skip
        elif rows.host:  # synchronous (not run_ahead): the sequences wait for it as they are
            handle = StepHandle.deferred(
                lambda: self._sample(logits, seqs, rows, pending, eos_token_ids)
            )
        else:
            sampler = self._on_device(logits, seqs, rows, pending, eos_token_ids)
            handle = StepHandle.deferred(lambda: self._finish(sampler(), seqs, rows))
        handle.run_ahead = rows.run_ahead
        return handle

    @torch.inference_mode()
    def _sample(
        self,
        logits: torch.Tensor | DeviceSamples | None,
        seqs: list[Sequence],
        rows: StepRows,
        pending: torch.Tensor | None,
        eos_token_ids: set[int],
    ) -> StepHandle:
        if logits is None:
            handle = StepHandle(outputs=[])
        elif isinstance(logits, DeviceSamples):
            handle = StepHandle.copy_to_host(logits.token_ids,
                                             sampled_logits=logits.sampled_logits)  # fmt: skip
        else:
            handle = self._sample_logits(logits, seqs, rows, pending, eos_token_ids)
        return self._finish(handle, seqs, rows)

    @staticmethod
    def _finish(handle: StepHandle, seqs: list[Sequence], rows: StepRows) -> StepHandle:
        """handle, told its rows' sequences and whether the next step may run ahead of it."""
        handle.seqs = seqs
        handle.run_ahead = handle.plain and rows.run_ahead
        return handle

    def sample_drafts(
        self,
        logits: torch.Tensor | DeviceSamples,
        seqs: list[Sequence],
        rows: StepRows,
        drafts: list[list[int]],
        eos_token_ids: set[int],
    ) -> StepHandle:
        """A step with drafts: each sampled row's new tokens (a list of 1 .. d + 1) from its
        logits rows ([sum(d_i + 1), vocab]: the row's last token's, then one per draft), or
        the draws at those positions, sampled in the decode graph (draft_settings).
        Its rows are plain (speculation refuses the rest) but for min_tokens, whose rows carry
        no drafts (Scheduler._may_draft): their one row is masked as usual."""
        assert not (rows.host or rows.penalties or rows.constrained), rows
        assert all(w is None for w in rows.logprob_widths), "logprobs are refused"
        if isinstance(logits, DeviceSamples):  # drawn in the decode graph (draft_settings)
            handle = DraftStepHandle.of_draws(logits, drafts)
            handle.seqs = seqs
            return handle
        if rows.early:
            per_row = [s for s, d in zip(seqs, drafts) for _ in range(len(d) + 1)]
            mask_early_stops(logits, per_row, eos_token_ids)
        handle = verify_drafts(logits, self.settings(seqs), drafts)
        handle.seqs = seqs
        return handle

    def _replay(self, sampler: GraphSampler, seqs: list[Sequence]) -> StepHandle:
        """A decode graph's masked sampler, replayed once the rows' masks are in its buffers."""
        self.token_mask(seqs, into=sampler)
        samples = sampler.replay()
        return StepHandle.copy_to_host(samples.token_ids, sampled_logits=samples.sampled_logits)

    def token_mask(self, seqs: list[Sequence], into: GraphSampler | None = None
                   ) -> TokenMask | None:  # fmt: skip
        """The allowed tokens of the rows whose sequence has a grammar, on the logits' device;
        None when no row has one. Most were filled on the host while the engine finished the
        previous step (StructuredBackend.fill_ahead); the rest are filled now, while the device
        runs this step's forward pass. A sequence that finished while the step was in flight
        drops its row's token: its row is left unmasked, its matcher unread.
        into: a decode graph's sampler, whose buffers take the masks (then None is returned)."""
        matched = [(s.matcher, i) for i, s in enumerate(seqs)
                   if s.matcher is not None and not s.is_finished]  # fmt: skip
        if not matched:
            if into is not None:
                into.rows.fill_(-1)
            return None
        started = time.perf_counter()
        gpu = platform_of(self.device).gpu
        host, slots = self.structured.masks([m for m, _ in matched], pin=gpu)
        rows = [-1] * len(seqs)
        for (_, i), k in zip(matched, slots):
            rows[i] = k
        index = pinned(torch.tensor(rows, dtype=torch.int32))
        words, index = self._copy_masks(host, index, into)
        # The next fill writes the host rows again once this copy has read them.
        self.structured.stage_read = self._masks_copied if gpu else None
        self.structured.stats.add_mask_time(started)
        return TokenMask(words, index)

    def _copy_masks(
        self, words: torch.Tensor, index: torch.Tensor, into: GraphSampler | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The host masks on the device (into a decode graph's buffers), queued after the
        forward pass on the step's stream, where the sampler reads them. (A stream of their
        own let the copy start sooner; the host time it took to switch streams every step did
        not pay: a constrained step is bound by the host, and the same within noise either way
        on an H100.)"""
        if not platform_of(self.device).gpu:
            return words, index
        if into is not None:
            assert len(words) <= len(into.words), (words.shape, into.words.shape)
            into.words[: len(words)].copy_(words, non_blocking=True)
            into.rows.copy_(index, non_blocking=True)
            words, index = into.words, into.rows
        else:
            words = words.to(self.device, non_blocking=True)
            index = index.to(self.device, non_blocking=True)
        self._masks_copied = torch.cuda.Event()
        self._masks_copied.record()
        return words, index

    def _sample_logits(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        rows: StepRows,
        pending: torch.Tensor | None,
        eos_token_ids: set[int],
    ) -> StepHandle:
        if rows.host:
            mask = self.token_mask(seqs) if rows.constrained else None
            counts = self._penalty_counts(logits) if rows.penalties else None
            outputs = sample_sequences(logits.float(), seqs, eos_token_ids, pending, counts, mask)
            return StepHandle.of_outputs(outputs)
        return self._on_device(logits, seqs, rows, pending, eos_token_ids)()

    def _penalty_counts(self, logits: torch.Tensor) -> PenaltyCounts:
        """The penalized sequences' token counts on the device (made on first use)."""
        if self.penalty_counts is None:
            self.penalty_counts = PenaltyCounts(logits.shape[-1], logits.device)
        return self.penalty_counts

    def _on_device(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        rows: StepRows,
        pending: torch.Tensor | None,
        eos_token_ids: set[int],
    ) -> Callable[[], StepHandle]:
        """The device path: what reads the sequences' token counts now (penalties, settings,
        the output counts min_tokens compares), the masks and draws when the returned
        function runs: at once, or for grammar rows once their matchers moved on
        (StepHandle.deferred), since a finished grammar lifts min_tokens' mask."""
        if rows.penalties:
            # Penalized rows stay plain (asynchronous): their counts take a pending token
            # from the previous step's samples on the device.
            logits = penalize(logits.float(), seqs, pending, self._penalty_counts(logits))
        st = self.settings(seqs)
        outputs = [s.num_output_tokens for s in seqs] if rows.early else None

        @torch.inference_mode()
        def draw() -> StepHandle:
            if rows.early:
                mask_early_stops(logits, seqs, eos_token_ids, outputs)
            mask = self.token_mask(seqs) if rows.constrained else None
            return self._draw(logits, st, rows, mask)

        return draw

    def _draw(
        self, logits: torch.Tensor, st: SamplingTensors, rows: StepRows, mask: TokenMask | None
    ) -> StepHandle:
        """The fused kernel's draws (and raw logprobs where rows ask) from prepared logits."""
        widths = rows.logprob_widths
        if all(w is None for w in widths):
            tokens = sample(logits, st, mask=mask).token_ids
            picked = logits.gather(1, tokens[:, None])[:, 0]
            return StepHandle.copy_to_host(tokens, sampled_logits=picked)
        # Raw logprobs in the same pass; no row here is masked (see rows.on_host).
        k = min(max(w or 0 for w in widths), logits.shape[-1])
        out = sample(logits, st, k, need_logprobs=True, mask=mask)
        picked = logits.gather(1, out.token_ids[:, None])
        ranks = (logits > picked).sum(dim=-1) + 1  # 1-based rank of the sampled token
        top_v = out.top_logprobs if k else out.logprobs[:, None][:, :0]
        top_i = out.top_token_ids if k else out.token_ids[:, None][:, :0]
        logprobs = (out.logprobs, top_v, top_i, ranks)
        return StepHandle.copy_to_host(out.token_ids, logprobs, widths, picked[:, 0])

    def warm_up(self, dtype: torch.dtype) -> None:
        """Compile the sampler kernel's three variants (plain; the sampled tokens' logprobs;
        top logprobs too) and every path of SAMPLER_PATHS (the greedy argmax, the chunked
        draws) now, not inside the first steps that ask for them: a compile there stalls every
        running request. Batch sizes and logprob counts compile none."""
        logits = torch.zeros(3, self.vocab_size, dtype=dtype, device=self.device)
        self.profile(logits, num_logprobs=0)
        st = self.profile(logits, num_logprobs=1)
        sample(logits, st, need_logprobs=True)
        for path in SAMPLER_PATHS:  # each path without logprobs; greedy: the argmax kernels
            sample(logits, with_path(st, path))

    def profile(self, logits: torch.Tensor, num_logprobs: int = 20) -> SamplingTensors:
        """Run the most memory-hungry path over logits rows ([rows, vocab]), for the memory
        profile; returns the settings it ran with."""
        rows, vocab = logits.shape
        dev = logits.device
        ones = torch.ones(rows, device=dev)
        st = SamplingTensors(
            temperatures=ones,
            top_ks=torch.full((rows,), max(1, vocab // 2), dtype=torch.int32, device=dev),
            top_ps=ones * 0.9,
            min_ps=ones * 0.01,
            seeds=torch.zeros(rows, dtype=torch.int64, device=dev),
            offsets=torch.zeros(rows, dtype=torch.int64, device=dev),
        )
        num_logprobs = min(num_logprobs, vocab)
        sample(logits, st, num_logprobs=num_logprobs)
        if num_logprobs:
            logits.log_softmax(-1).topk(num_logprobs, dim=-1)
        return st
