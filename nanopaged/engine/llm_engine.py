"""The step loop: schedule, launch, plan the next step while the device runs, commit."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

from tqdm.auto import tqdm

from nanopaged.distributed.workers import TPWorkers
from nanopaged.engine.block_manager import BlockManager
from nanopaged.engine.group import SequenceGroup
from nanopaged.engine.model_runner import ModelRunner, StepHandle
from nanopaged.engine.output_processor import StopMatcher
from nanopaged.engine.scheduler import ScheduledBatch, Scheduler
from nanopaged.engine.sequence import Sequence

# Steps between collections of the garbage collector's young generations during a run.
GC_YOUNG_EVERY = 64


class StepRates:
    """Prefill and decode throughput, each over the time of the steps that did that kind of
    work (a step's time: from the previous step's samples to its own)."""

    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.tokens = {"prefill": 0, "decode": 0}
        self.seconds = {"prefill": 0.0, "decode": 0.0}

    def add(self, num_prefill: int, num_decode: int) -> None:
        now = time.perf_counter()
        dt, self.last = now - self.last, now
        for kind, n in (("prefill", num_prefill), ("decode", num_decode)):
            if n:
                self.tokens[kind] += n
                self.seconds[kind] += dt

    def describe(self) -> str:
        return ", ".join(
            f"{kind} {self.tokens[kind] / max(self.seconds[kind], 1e-9):.0f} tok/s"
            for kind in ("prefill", "decode")
        )


class LLMEngine:
    """Runs groups of sequences to completion over one scheduler and one model runner."""

    def __init__(
        self,
        scheduler: Scheduler,
        block_manager: BlockManager,
        runner: ModelRunner,
        eos_token_ids: set[int],
        tokenizer,
        async_scheduling: bool,
        workers: TPWorkers | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.stop_matcher = StopMatcher(tokenizer)
        self.async_scheduling = async_scheduling
        self.workers = workers

    def may_run_ahead(self, batch: ScheduledBatch, handle: StepHandle) -> bool:
        """The one decision: may the next step be planned and launched before this one's
        samples reach the host? Only when its samples stay on the device (a plain step) and no
        structural event (fork, copy-on-write, preemption, swap, beam step) needs them first.
        Prompt logprobs the step scores travel with its samples and are recorded at its commit,
        and the next step scores none of their positions: they hold nothing back."""
        return self.async_scheduling and handle.plain and self.scheduler.can_look_ahead(batch)

    def run(self, groups: list[SequenceGroup], use_tqdm: bool) -> None:
        """Run every group to completion; on any error or interruption nothing stays held."""
        for _ in self.run_iter(groups, use_tqdm):
            pass

    def run_iter(self, groups: list[SequenceGroup], use_tqdm: bool) -> Iterator[SequenceGroup]:
        """Run every group to completion, yielding each as it finishes. Closing the iterator
        early (break, an error, Ctrl-C) aborts the groups left and frees their blocks."""
        bar = tqdm(total=len(groups), desc="Processed prompts", disable=not use_tqdm, leave=True)
        rates = StepRates()
        # No full garbage collection while the run lasts: one walks every object of the
        # process (the model's, the tokenizer's, the run's logprob rows), a 0.3-0.4 s pause
        # at a time in a logprobs run. The young generations are collected every
        # GC_YOUNG_EVERY steps instead; automatic collection is back as it was while the
        # caller holds control (between yields) and afterwards.
        collecting = gc.isenabled()
        gc.disable()
        num_loops = 0
        try:
            self.block_manager.reset_peaks()
            for group in groups:
                self.scheduler.add(group)
            in_flight = None  # a launched step planned before its predecessor's samples
            while in_flight is not None or self.scheduler.has_unfinished():
                num_loops += 1
                if collecting and num_loops % GC_YOUNG_EVERY == 0:
                    gc.collect(1)
                if in_flight is None:
                    batch = self.scheduler.schedule()
                    if not batch.seqs:
                        raise RuntimeError("the scheduler could not make progress")  # invariant
                    handle = self.runner.launch(batch, self.eos_token_ids)
                else:
                    (batch, handle), in_flight = in_flight, None
                # A decode row computes the last sampled token; prompts are prefill, however short.
                num_decode = sum(
                    1
                    for seq, n in zip(batch.seqs, batch.num_scheduled_tokens)
                    if n == 1
                    and seq.num_output_tokens > 0
                    and seq.num_computed_tokens == len(seq) - 1
                )
                num_prefill = batch.total_tokens - num_decode
                if self.may_run_ahead(batch, handle):
                    # Plan and launch the next step while this one runs on the device.
                    self.scheduler.advance(batch)
                    following = self.scheduler.schedule()
                    if following.seqs:
                        in_flight = (
                            following,
                            self.runner.launch(following, self.eos_token_ids, prev=handle),
                        )
                    step = self.scheduler.commit(
                        batch, handle.result(), handle.logprobs(), handle.prompt_logprobs()
                    )
                else:
                    step = self.scheduler.postprocess(
                        batch, handle.result(), handle.logprobs(), handle.prompt_logprobs()
                    )
                stopped = self._check_stop_strings(step.grown)
                # Two samples of one request can both stop here: each request once.
                done = {id(g): g for g in step.finished_groups}
                done.update((id(s.group), s.group) for s in stopped if s.group.is_finished)
                rates.add(num_prefill, num_decode)
                if use_tqdm:
                    bar.set_postfix_str(rates.describe(), refresh=False)
                if done:
                    bar.update(len(done))
                    if collecting:
                        gc.enable()
                    yield from done.values()
                    gc.disable()
        except BaseException:
            # Interrupted or failed mid-step: give every block back so the LLM stays usable.
            self.scheduler.abort_all()
            # No request outlives this call, so no block may stay held, even one that a step
            # cut short left outside the scheduler's lists.
            self.block_manager.free_all()
            if self.workers is not None:
                # A step cut short leaves the workers out of step; a worker's error wins.
                self.workers.after_error()
            raise
        finally:
            if collecting:
                gc.enable()
            bar.close()

    def _check_stop_strings(self, seqs: list[Sequence]) -> list[Sequence]:
        """Finish sequences whose text now holds a stop string; returns those it finished."""
        # A stop string may only end in text that appears once min_tokens tokens are out:
        # in the text of a token after the first min_tokens (the first that EOS may be).
        watched = [
            s for s in seqs
            if s.sampling_params.stop and s.num_output_tokens > s.sampling_params.min_tokens
        ]  # fmt: skip
        if not watched:
            return []
        finished = []
        for seq, idx, stop, full in self.stop_matcher.find(watched):
            p = seq.sampling_params
            seq.text = full[: idx + len(stop)] if p.include_stop_str_in_output else full[:idx]
            if seq.is_finished:  # ended by length or EOS this very step: the string wins
                seq.finish_reason, seq.stop_reason = "stop", stop
            else:
                self.scheduler.finish(seq, "stop", stop)
                finished.append(seq)
        return finished
