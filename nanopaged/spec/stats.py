"""How well a run's speculation pays: drafts proposed, accepted, and tokens per verified row."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass
class SpecStats:
    """Counts over the rows that carried drafts (a row without drafts is a plain decode row)."""

    num_verify_rows: int = 0  # rows verified with at least one draft
    num_draft_tokens: int = 0  # drafts proposed in them
    num_accepted_tokens: int = 0  # drafts the rejection sampler accepted

    def add(self, num_drafts: int, num_accepted: int) -> None:
        self.num_verify_rows += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts (0.0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verified row emits on average: its accepted drafts plus the one token the
        target adds (a correction or bonus); 0.0 before any draft."""
        if not self.num_verify_rows:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_verify_rows

    def copy(self) -> SpecStats:
        return replace(self)

    def since(self, earlier: SpecStats) -> SpecStats:
        """The counts added after `earlier` (a copy taken before)."""
        return SpecStats(
            num_verify_rows=self.num_verify_rows - earlier.num_verify_rows,
            num_draft_tokens=self.num_draft_tokens - earlier.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens - earlier.num_accepted_tokens,
        )

    def describe(self) -> str:
        return (f"{self.num_draft_tokens} drafts in {self.num_verify_rows} rows, "
                f"{100 * self.acceptance_rate:.1f}% accepted, "
                f"{self.mean_accepted_length:.2f} tokens per verified row")  # fmt: skip

    def as_dict(self) -> dict[str, float | int]:
        return dict(num_verify_rows=self.num_verify_rows, num_draft_tokens=self.num_draft_tokens,
                    num_accepted_tokens=self.num_accepted_tokens,
                    acceptance_rate=self.acceptance_rate,
                    mean_accepted_length=self.mean_accepted_length)  # fmt: skip
