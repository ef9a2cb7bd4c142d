"""A hand-computable stand-in for the device, for scheduler tests (no JAX): a "KV cache" of
token ids that every step writes through the page tables and reads back, so a page mix-up, a
lost page, a wrong copy or a wrong rollback changes the tokens it computes."""

from __future__ import annotations

import dataclasses
import random

import numpy as np

from infer.cache.page_allocator import PageAllocator
from infer.engine.plan import InFlight, SeqState, StepPlan

VOCAB = 97
EOS = 0
POISON = -2  # written where only a stale step writes


def next_token(tokens: list[int]) -> int:
    """The mock model: a deterministic function of the whole sequence, never EOS by itself."""
    h = 7
    for t in tokens:
        h = (h * 31 + t) % 1_000_003
    return 1 + h % (VOCAB - 1)


def alone(prompt: list[int], n: int) -> list[int]:
    """The n tokens a request gets when it runs by itself."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


class PageReadingRunner:
    """Prefill chunks and decode rows write their tokens into their pages and compute the next
    token from what they read back. A decode row with a draft limit also writes drafts, each
    right with probability `p_right`, and keeps those the model agrees with, as exact
    verification does."""

    def __init__(self, allocator: PageAllocator, rng: random.Random | None = None,
                 p_right: float = 1.0) -> None:
        self.kv = np.full((allocator.num_pages, allocator.page_size), -1, np.int64)
        self.g = allocator.page_size
        self.rng = rng or random.Random(0)
        self.p_right = p_right

    def _write(self, seq: SeqState, pos: int, token: int) -> None:
        pages = seq.pages.pages
        assert pos < len(pages) * self.g, f"write at {pos} past the {len(pages)} pages held"
        self.kv[pages[pos // self.g], pos % self.g] = token

    def _read(self, seq: SeqState, n: int) -> list[int]:
        pages = seq.pages.pages
        return [int(self.kv[pages[p // self.g], p % self.g]) for p in range(n)]

    def dispatch(self, plan: StepPlan, after: InFlight | None = None) -> InFlight:
        """Runs the plan when its tokens are asked for, as a device runs a step only after the
        steps dispatched before it: a step planned ahead then finds the step it follows written
        and its token appended (its `after` feed is that token, `last_token_id`)."""
        assert plan.ahead == (after is not None)
        if not plan.ahead:
            return InFlight(plan, lambda: (self.execute(plan), None))
        # What the device would be given now: each row's pages and the slot it writes.
        targets = [(list(s.pages.pages), s.num_computed + 1) for s in plan.decode]
        return InFlight(plan, lambda: (self.execute(plan, targets), None))

    def execute(self, plan: StepPlan,
                ahead_targets: list[tuple[list[int], int]] | None = None) -> list[list[int]]:
        """`ahead_targets`: a step planned ahead, with each row's pages and slot at dispatch.
        A row whose request finished or was aborted since still writes there, as the device
        would: poison that any later read of the slot would turn into a wrong token."""
        if ahead_targets is not None:
            out = []
            for seq, (pages, slot) in zip(plan.decode, ahead_targets):
                if seq.status.value != "running":
                    self.kv[pages[slot // self.g], slot % self.g] = POISON
                    out.append([1])
                    continue
                # The step it followed has been postprocessed: its token is the one fed.
                assert seq.num_computed == slot and seq.decode_ready, (seq.num_computed, slot)
                out += self.execute(dataclasses.replace(plan, decode=[seq], draft_limits=[0],
                                                        ahead=False))
            return out
        assert plan.kind == "idle" or not plan.empty, f"a {plan.kind} step with no rows"
        # Gather before scattering: a copy's destination may be another copy's source.
        copies = [(dst, self.kv[src].copy()) for src, dst in plan.page_copies]
        for dst, data in copies:
            self.kv[dst] = data
        out = []
        for chunk in plan.prefill:
            for i, t in enumerate(chunk.token_ids):
                self._write(chunk.seq, chunk.start + i, t)
            out.append([next_token(self._read(chunk.seq, chunk.start + len(chunk.token_ids)))])
        limits = plan.draft_limits or [0] * len(plan.decode)
        for seq, limit in zip(plan.decode, limits):
            true = seq.request.all_token_ids
            drafts: list[int] = []
            for _ in range(limit):
                right = next_token(true + drafts)
                drafts.append(right if self.rng.random() < self.p_right
                              else 1 + (right % (VOCAB - 1)))
            fed = [seq.request.last_token_id] + drafts
            for i, t in enumerate(fed):
                self._write(seq, seq.num_computed + i, t)
            emitted = []
            for i in range(len(fed)):
                target = next_token(self._read(seq, seq.num_computed + i + 1))
                emitted.append(target)
                if i == len(drafts) or drafts[i] != target:
                    break
            out.append(emitted)
        return out
