"""Proposers for speculative decoding: who guesses the next tokens that the target verifies.

A proposer is asked, before each speculative decode step, for up to `limits[i]` draft tokens per
row; it answers with host arrays (drafts [rows, k], counts [rows]) and, when its drafts were
sampled from a distribution, that distribution [rows, k, V] on device (None for deterministic
proposals, which the verifier treats as point masses). After the step it is told what each row
emitted (and the target's final hidden states at the fed positions), and after each prefill
chunk it sees that chunk's hidden states, so a proposer with state of its own can keep up.
Model proposers (a draft model, an EAGLE head) are in `infer.spec.model_proposers`. With a tree
(`SpeculativeConfig.tree`, EAGLE only) the runner asks `propose_tree` instead: one candidate tree
per row, verified with a tree mask (`EagleProposer.propose_tree`).
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import jax
import numpy as np

from infer.engine.plan import PrefillChunk, SeqState
from infer.engine.request import Request


class Proposer(Protocol):
    samples_drafts: bool  # drafts may come with probabilities (sampled requests)
    # The target's layers whose outputs come with its final hidden states in the `hidden`
    # that commit and observe_prefill see (`Llama.__call__`): () for all but an EAGLE-3 head.
    feature_layers: tuple[int, ...]
    # Its per-request state follows from the request's tokens alone (a host proposer's index),
    # so a preemption, which keeps the tokens and drops the pages, leaves it valid.
    state_from_tokens: bool

    def propose(self, seqs: Sequence[SeqState], limits: Sequence[int], rows: int, k: int
                ) -> tuple[np.ndarray, np.ndarray, jax.Array | None]: ...

    def commit(self, seqs: Sequence[SeqState], emitted: Sequence[Sequence[int]],
               hidden: jax.Array) -> None: ...

    def observe_prefill(self, chunks: Sequence[PrefillChunk], hidden: jax.Array) -> None: ...

    def forget(self, request_id: str) -> None: ...

    def warmup(self) -> int: ...




class TokenIndex(Protocol):
    """A host proposer's per-request index over the tokens a request has so far: it only grows
    (rejected drafts are never appended)."""
    tokens: list[int]

    def extend(self, tokens: Sequence[int]) -> None: ...


def catch_up(index: TokenIndex, request: Request, upto: int | None = None) -> None:
    """Appends to `index` the request's tokens it has not seen, through token `upto` (all by
    default): the rest of the prompt, then the outputs accepted since its last proposal."""
    known = len(index.tokens)
    prompt = request.prompt_token_ids
    end = len(prompt) + len(request.output_ids) if upto is None else upto
    if known < min(len(prompt), end):
        index.extend(prompt[known:end])
        known = min(len(prompt), end)
    if known < end:
        index.extend(request.output_ids[known - len(prompt):end - len(prompt)])


def index_for(indexes: dict[str, TokenIndex], make: Callable[[], TokenIndex], request: Request,
              upto: int | None = None) -> TokenIndex:
    """The request's index in `indexes` (made by `make` at its first use), caught up through
    token `upto` (all its tokens by default)."""
    index = indexes.get(request.request_id)
    if index is None:
        index = indexes[request.request_id] = make()
    catch_up(index, request, upto)
    return index


def observe_chunks(indexes: dict[str, TokenIndex], make: Callable[[], TokenIndex],
                   chunks: Sequence[PrefillChunk]) -> None:
    """A host proposer's indexes caught up with each prefill chunk's tokens, a chunk at a time:
    built at the first proposal instead, a long prompt's index stalled that whole step for
    every row of the batch (seconds for a suffix index over tens of thousands of tokens). Rows
    that never draft (logprobs, structured output) build none."""
    for chunk in chunks:
        if not chunk.seq.request.params.plain_steps_only:
            index_for(indexes, make, chunk.seq.request, chunk.start + len(chunk.token_ids))


def pack_drafts(proposals: Sequence[Sequence[int]], rows: int, k: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """A host proposer's per-row token lists (each at most k long) as `propose` answers them:
    drafts [rows, k] int32 (zeros past each row's count) and counts [rows]."""
    drafts = np.zeros((rows, k), np.int32)
    counts = np.zeros(rows, np.int32)
    for i, proposal in enumerate(proposals):
        drafts[i, :len(proposal)] = proposal
        counts[i] = len(proposal)
    return drafts, counts
