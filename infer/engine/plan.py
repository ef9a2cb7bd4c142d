"""The contract the runner and the proposers read: the scheduler's decision for one step (which
sequences run, which prefill chunks, which page copies), not the scheduler itself. Plain Python,
no JAX.

Each idea has one owner here: a sequence's cached-token count is its pages' `num_tokens` (the
allocator's truncate and copy-on-write reason about it), and whether it is finished is its
request's `finished` (the finish reason); `SeqState` only reads them."""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING, Callable

from infer.cache.page_allocator import SequencePages
from infer.engine.request import Request, TokenLogprob

if TYPE_CHECKING:
    import jax


def check_step_kinds(mixed_steps: bool, num_speculative_tokens: int) -> None:
    """A mixed step (a prefill chunk and the decode rows in one forward) verifies no drafts:
    the scheduler, the runner and the engine's config refuse the two together."""
    if mixed_steps and num_speculative_tokens:
        raise ValueError("mixed steps do not combine with speculative decoding")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class SeqState:
    """The scheduler's view of one request."""

    request: Request
    pages: SequencePages
    # Admission order while it holds a slot (for choosing whom to preempt); -1 while waiting.
    admitted_at: int = -1
    # Of this admission: tokens taken from the prefix cache, and how many of them lead the
    # sequence, taken before it computed any itself (a model proposer reuses the draft KV of
    # those it knows a draft filled; later ones follow pages this request computed).
    reused_tokens: int = 0
    cached_prefix: int = 0

    @property
    def status(self) -> Status:
        """FINISHED once its request is (the one finished state); otherwise RUNNING while it
        holds a slot, WAITING in the queue."""
        if self.request.finished:
            return Status.FINISHED
        return Status.RUNNING if self.admitted_at >= 0 else Status.WAITING

    @property
    def finished(self) -> bool:
        return self.request.finished

    @property
    def num_computed(self) -> int:
        """Tokens of request.all_token_ids whose KV is in the cache: its pages' count."""
        return self.pages.num_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_token_ids) + len(self.request.output_ids)

    @property
    def label(self) -> str:
        """How errors name it: "request 'id'"."""
        return f"request {self.request.request_id!r}"

    @property
    def in_prefill(self) -> bool:
        """More than one token lacks KV. (With exactly one missing -- the token just sampled, or
        the last of a prompt -- a decode step is the same computation as a 1-token prefill.)"""
        return self.num_computed < self.num_tokens - 1

    @property
    def decode_ready(self) -> bool:
        return self.num_computed == self.num_tokens - 1 and not self.finished


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
    kind: str  # "prefill", "decode", "mixed" (a chunk and decode rows) or "idle"
    prefill: list[PrefillChunk] = dataclasses.field(default_factory=list)
    decode: list[SeqState] = dataclasses.field(default_factory=list)
    page_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    preempted: list[SeqState] = dataclasses.field(default_factory=list)
    decode_width: int = 0  # rows the decode batch occupies, padding included (static batches)
    draft_limits: list[int] = dataclasses.field(default_factory=list)  # per decode row
    # Planned by `Scheduler.plan_ahead` while the step before it was in flight: each row feeds
    # that step's token from the device, one slot past the sequence's computed tokens.
    ahead: bool = False

    @property
    def empty(self) -> bool:
        """Nothing to compute: no chunk and no decode row."""
        return not self.prefill and not self.decode


# Per prefill chunk, then per decode row: the tokens a step emitted, and their logprobs (None
# for a row that asked for none), or None for the whole step when no row asked.
Emitted = list[list[int]]
EmittedLogprobs = list[list[TokenLogprob | None]] | None


class InFlight:
    """A dispatched step: its plan, and its tokens once the device has them (`result` blocks).

    `feed` is the step's sampled tokens [rows] still on the device: the input of a decode step
    over the same rows planned before these tokens reach the host (`Scheduler.plan_ahead`)."""

    def __init__(self, plan: StepPlan, collect: Callable[[], tuple[Emitted, EmittedLogprobs]],
                 feed: "jax.Array | None" = None) -> None:
        self.plan = plan
        self.feed = feed
        self._collect: Callable[[], tuple[Emitted, EmittedLogprobs]] | None = collect
        self._tokens: Emitted = []
        self._logprobs: EmittedLogprobs = None

    @classmethod
    def done(cls, plan: StepPlan, tokens: Emitted, logprobs: EmittedLogprobs = None
             ) -> "InFlight":
        """A step whose tokens are already on the host."""
        return cls(plan, lambda: (tokens, logprobs))

    def result(self) -> Emitted:
        """The tokens of each prefill chunk, then of each decode row (`Runner.execute`)."""
        if self._collect is not None:
            (self._tokens, self._logprobs), self._collect = self._collect(), None
        return self._tokens

    def logprobs(self) -> EmittedLogprobs:
        """The logprobs of `result()`'s tokens, where asked."""
        self.result()
        return self._logprobs

    def live(self) -> bool:
        """Some sequence of the plan still runs (the others finished or were aborted since)."""
        return any(s.status == Status.RUNNING
                   for s in [c.seq for c in self.plan.prefill] + self.plan.decode)
