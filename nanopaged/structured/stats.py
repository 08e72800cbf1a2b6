"""Where structured outputs spend host time: compiles, the engine's waits for them, the masks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class StructuredStats:
    """Counters kept by one engine's StructuredBackend (made at its first constrained request,
    so an engine that never saw one counts nothing); bench.py reads them."""

    # Wall seconds of each grammar compiled (in the compile pool, side by side), in order.
    compile_seconds: list[float] = field(default_factory=list)
    # Seconds the engine blocked on a compile because nothing else could run.
    waited_seconds: float = 0.0
    # Steps that filled masks, and their host seconds: the batch fill plus the copy's launch.
    mask_steps: int = 0
    mask_seconds: float = 0.0
    # Host seconds advancing matchers past sampled tokens (StructuredBackend.accept), and
    # filling their next masks right after (fill_ahead).
    accept_seconds: float = 0.0
    prefetch_seconds: float = 0.0
    # time.perf_counter() at the first mask filled since the last reset (None: none yet).
    first_mask_at: float | None = None

    def add_mask_time(self, started: float) -> None:
        """Count one step's masks, filled from perf_counter() time `started` until now."""
        now = time.perf_counter()
        if self.first_mask_at is None:
            self.first_mask_at = started
        self.mask_steps += 1
        self.mask_seconds += now - started

    def reset(self) -> None:
        """Start counting afresh (a benchmark's timed run)."""
        self.compile_seconds = []
        self.waited_seconds = 0.0
        self.mask_steps = 0
        self.mask_seconds = 0.0
        self.accept_seconds = 0.0
        self.prefetch_seconds = 0.0
        self.first_mask_at = None

    def summary(self) -> dict:
        """The counters as figures: compiles (count, mean, max, sum of their wall seconds),
        the engine's blocked wait, and per step that filled masks the mean mask time, time
        advancing matchers, and filling masks ahead (prefetch)."""
        compiles = self.compile_seconds
        return dict(
            compiles=len(compiles),
            compile_mean_s=sum(compiles) / len(compiles) if compiles else 0.0,
            compile_max_s=max(compiles, default=0.0),
            compile_total_s=sum(compiles),
            waited_for_compile_s=self.waited_seconds,
            mask_steps=self.mask_steps,
            mask_mean_ms=1e3 * self.mask_seconds / max(1, self.mask_steps),
            accept_mean_ms=1e3 * self.accept_seconds / max(1, self.mask_steps),
            prefetch_mean_ms=1e3 * self.prefetch_seconds / max(1, self.mask_steps),
        )
