"""A recorder of what an engine's proposer answers, for tests that check drafts call by call."""

from __future__ import annotations

import dataclasses

import numpy as np

from infer.engine.engine import Engine


@dataclasses.dataclass(frozen=True)
class Proposal:
    """One propose call, as host values, its rows cut to the call's sequences."""

    tokens: list[list[int]]  # each row's tokens before the drafts
    limits: list[int]
    drafts: np.ndarray  # [rows, k]
    counts: np.ndarray  # [rows]
    probs: np.ndarray | None  # [rows, k, V] for sampled drafts


def record_proposals(engine: Engine) -> list[Proposal]:
    """The list every later propose call of `engine`'s proposer is appended to."""
    calls: list[Proposal] = []
    proposer = engine.runner.proposer
    propose = proposer.propose

    def recording(seqs, limits, rows, k):
        drafts, counts, probs = propose(seqs, limits, rows, k)
        n = len(seqs)
        calls.append(Proposal([list(s.request.all_token_ids) for s in seqs], list(limits),
                              np.asarray(drafts)[:n].copy(), np.asarray(counts)[:n].copy(),
                              None if probs is None else np.asarray(probs)[:n]))
        return drafts, counts, probs

    proposer.propose = recording
    return calls
