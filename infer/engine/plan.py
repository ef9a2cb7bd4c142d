"""The scheduler's decision for one step, the contract the runner and the proposers read: which
sequences run, which prefill chunks, which page copies. Plain Python, no JAX."""

from __future__ import annotations

import dataclasses
import enum

from infer.cache.page_allocator import SequencePages
from infer.engine.request import Request


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"

@dataclasses.dataclass
class SeqState:
    """The scheduler's view of one request."""

    request: Request
    pages: SequencePages
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens of request.all_token_ids whose KV is in the cache
    admitted_at: int = -1  # admission order, for choosing whom to preempt

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.request.output_ids)

    @property
    def in_prefill(self) -> bool:
        """More than one token lacks KV. (With exactly one missing -- the token just sampled, or
        the last of a prompt -- a decode step is the same computation as a 1-token prefill.)"""
        return self.num_computed < self.num_tokens - 1

    @property
    def decode_ready(self) -> bool:
        return self.num_computed == self.num_tokens - 1 and not self.request.finished

@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    seq: SeqState
    start: int  # first token of the chunk (all cache slots before it are computed)
    token_ids: tuple[int, ...]

    @property
    def completes(self) -> bool:
        """The chunk reaches the last token, so the step's sampled token is the next output."""
        return self.start + len(self.token_ids) == self.seq.num_tokens

@dataclasses.dataclass
class StepPlan:
    kind: str  # "prefill", "decode" or "idle"
    prefill: list[PrefillChunk] = dataclasses.field(default_factory=list)
    decode: list[SeqState] = dataclasses.field(default_factory=list)
    page_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    preempted: list[SeqState] = dataclasses.field(default_factory=list)
    decode_width: int = 0  # rows the decode batch occupies, padding included (static batches)
    draft_limits: list[int] = dataclasses.field(default_factory=list)  # per decode row
