"""Proposers for speculative decoding: who guesses the next tokens that the target verifies.

A proposer is asked, before each speculative decode step, for up to `limits[i]` draft tokens per
row; it answers with host arrays (drafts [rows, k], counts [rows]) and, when its drafts were
sampled from a distribution, that distribution [rows, k, V] on device (None for deterministic
proposals, which the verifier treats as point masses). After the step it is told what each row
emitted (and the target's final hidden states at the fed positions), and after each prefill
chunk it sees that chunk's hidden states, so a proposer with state of its own can keep up.
Model proposers (a draft model, an EAGLE head) are in `infer.drafters`.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import jax
import numpy as np

from infer.ngram import NgramIndex
from infer.scheduler import PrefillChunk, SeqState


class Proposer(Protocol):
    samples_drafts: bool  # drafts may come with probabilities (sampled requests)

    def propose(self, seqs: Sequence[SeqState], limits: Sequence[int], rows: int, k: int
                ) -> tuple[np.ndarray, np.ndarray, jax.Array | None]: ...

    def commit(self, seqs: Sequence[SeqState], emitted: Sequence[Sequence[int]],
               hidden: jax.Array) -> None: ...

    def observe_prefill(self, chunks: Sequence[PrefillChunk], hidden: jax.Array) -> None: ...

    def forget(self, request_id: str) -> None: ...

    def warmup(self) -> int: ...


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's
    last n tokens (n from max_n down to min_n), from an index kept per request."""

    samples_drafts = False

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        self.max_n, self.min_n = max_n, min_n
        self._indexes: dict[str, NgramIndex] = {}

    def _index(self, seq: SeqState) -> NgramIndex:
        request = seq.request
        index = self._indexes.get(request.request_id)
        if index is None:
            index = self._indexes[request.request_id] = NgramIndex(max_n=self.max_n,
                                                                   min_n=self.min_n)
        known = len(index.tokens)
        prompt = request.prompt_token_ids
        if known < len(prompt):
            index.extend(prompt[known:])
            known = len(prompt)
        index.extend(request.output_ids[known - len(prompt):])
        return index

    def propose(self, seqs: Sequence[SeqState], limits: Sequence[int], rows: int, k: int
                ) -> tuple[np.ndarray, np.ndarray, None]:
        drafts = np.zeros((rows, k), np.int32)
        counts = np.zeros(rows, np.int32)
        for i, (seq, limit) in enumerate(zip(seqs, limits)):
            proposal = self._index(seq).propose(limit) if limit else []
            drafts[i, :len(proposal)] = proposal
            counts[i] = len(proposal)
        return drafts, counts, None

    def commit(self, seqs: Sequence[SeqState], emitted: Sequence[Sequence[int]],
               hidden: jax.Array) -> None:
        pass  # the index catches up from the request's tokens at the next proposal

    def observe_prefill(self, chunks: Sequence[PrefillChunk], hidden: jax.Array) -> None:
        pass

    def warmup(self) -> int:
        return 0

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
