"""A reduced draft vocabulary (FR-Spec): model drafts score only the N most frequent target ids
(`experiments.draft_vocab` ranks them on the target's own generations) through their rows of
the LM head. Choices map back to target ids before anything sees them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from infer.model.llama import Llama, dense
from infer.sampling_params import is_integer


def load_draft_vocab(path: str, size: int, vocab_size: int) -> np.ndarray:
    """The first `size` ids [N] int32 of the ranking at `path` (`experiments.draft_vocab`: an
    int32 array of target ids, most frequent first), checked: distinct ids of [0, vocab_size)."""
    if not is_integer(size) or not 1 <= size <= vocab_size:
        raise ValueError(f"draft_vocab_size must be an int in [1, {vocab_size}] (the target's "
                         f"vocabulary), got {size!r}")
    ranking = np.load(path, allow_pickle=False)
    if ranking.ndim != 1 or not np.issubdtype(ranking.dtype, np.integer):
        raise ValueError(f"draft vocabulary {path!r} must be a 1-D integer array of token ids, "
                         f"got {ranking.dtype} {ranking.shape}")
    if len(ranking) < size:
        raise ValueError(f"draft vocabulary {path!r} ranks {len(ranking)} ids; "
                         f"draft_vocab_size={size} asks for more")
    ids = ranking[:size].astype(np.int64)
    if ids.min() < 0 or ids.max() >= vocab_size or len(np.unique(ids)) != size:
        raise ValueError(f"the first {size} ids of {path!r} must be distinct token ids in "
                         f"[0, {vocab_size}): is it the ranking of this target's vocabulary?")
    return ids.astype(np.int32)


DraftVocab = tuple[jax.Array, jax.Array]  # (head rows [N, E], target ids [N] int32), on device


def draft_vocab_rows(model: Llama, ids: np.ndarray | None) -> DraftVocab | None:
    """The LM-head rows of `ids` (a copy, [N, E]) and the ids, on device; None: every id."""
    if ids is None:
        return None
    head = (model.embed if model.lm_head is None else model.lm_head)[...]
    return jnp.take(head, jnp.asarray(ids), axis=0), jnp.asarray(ids, jnp.int32)


def draft_logits(model: Llama, hidden: jax.Array, vocab: DraftVocab | None) -> jax.Array:
    """Logits of final hidden states [..., E] through `model`'s LM head: [..., V], or with
    `vocab` [..., N] over its rows only (a choice i there is target id vocab[1][i])."""
    return model.logits(hidden) if vocab is None else dense(hidden, vocab[0], "...e,ve->...v")
