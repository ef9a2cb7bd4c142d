"""Counts of a speculative run: drafts proposed and accepted, and what they bought."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class SpeculationStats:
    """Counts over the verify steps of a run (rows that proposed at least one draft)."""

    verify_steps: int = 0  # device passes that verified drafts
    rows: int = 0  # row verifications: one request in one verify step
    proposed: int = 0  # draft tokens proposed (with trees: candidates verified)
    accepted: int = 0  # draft tokens accepted (with trees: the accepted paths' nodes)

    def record(self, counts: np.ndarray, accepted: np.ndarray) -> None:
        used = counts > 0
        self.verify_steps += 1
        self.rows += int(used.sum())
        self.proposed += int(counts.sum())
        self.accepted += int(accepted[used].sum())

    def summary(self) -> dict[str, float]:
        """acceptance_rate = accepted / proposed; tokens_per_verify = tokens each verifying row
        produced on average (its accepted drafts and the target's own token), counted, as
        vLLM's acceptance counters are, before a stop token or max_tokens cuts the block: a
        request's last verify step may emit fewer. With trees, a
        row's candidates are alternatives and one path at most is accepted, so the rate is far
        below a chain's for the same head: compare trees by tokens_per_verify."""
        return {**dataclasses.asdict(self),
                "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
                "tokens_per_verify": (self.accepted + self.rows) / self.rows if self.rows else 0.0}
