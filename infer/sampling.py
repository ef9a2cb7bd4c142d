"""Sampling parameters, validated on the host, applied on device as per-row arrays.

Temperature, top-k, top-p and the PRNG key are arrays with one row per sequence, so a batch
mixes greedy and sampled requests and changing a value never recompiles. Each row draws with
`fold_in(key(seed), step)`: the tokens of a request depend on its seed and its own step count
only, never on what else shares the batch.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from infer.sampling_params import SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling parameters on device."""

    temperature: jax.Array  # [B] float32, 0 = greedy
    top_k: jax.Array  # [B] int32, 0 = off
    top_p: jax.Array  # [B] float32, 1 = off
    seeds: jax.Array  # [B] uint32

    @staticmethod
    def from_params(params: Sequence[SamplingParams], batch: int | None = None) -> "SamplingArrays":
        """Rows for `params`, padded with greedy rows up to `batch`. Every seed must be concrete:
        resolve unseeded params first (`SamplingParams.with_resolved_seed`), once per request,
        so its draws stay one stream across steps."""
        batch = len(params) if batch is None else batch
        if len(params) > batch:
            raise ValueError(f"{len(params)} sampling params for a batch of {batch}")
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            raise ValueError(f"sampling params of rows {unseeded} have seed=None; resolve each "
                             "request's seed once with SamplingParams.with_resolved_seed() first")
        pad = [SamplingParams(seed=0)] * (batch - len(params))
        rows = list(params) + pad
        return SamplingArrays(
            temperature=jnp.asarray([p.temperature for p in rows], jnp.float32),
            top_k=jnp.asarray([p.top_k for p in rows], jnp.int32),
            top_p=jnp.asarray([p.top_p for p in rows], jnp.float32),
            seeds=jnp.asarray(np.asarray([p.seed for p in rows], np.uint32)),
        )


def warp_logits(logits: jax.Array, sampling: SamplingArrays) -> jax.Array:
    """Logits [B, V] -> the logits whose softmax is each row's sampling distribution:
    divided by the temperature, with tokens outside top-k and outside the top-p nucleus at -inf.
    Greedy rows are returned at temperature 1 (their distribution is not used)."""
    temperature = jnp.where(sampling.temperature > 0, sampling.temperature, 1.0)
    scaled = logits.astype(jnp.float32) / temperature[:, None]
    needs_sort = jnp.any((sampling.top_k > 0) | (sampling.top_p < 1.0))
    # The full-vocabulary sort costs more than the rest of sampling: skip it when no row asks.
    return jax.lax.cond(needs_sort, _truncate, lambda x, s: x, scaled, sampling)


def _truncate(scaled: jax.Array, sampling: SamplingArrays) -> jax.Array:
    vocab = scaled.shape[-1]
    ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
    rank = jnp.arange(vocab)[None, :]
    top_k = jnp.where(sampling.top_k > 0, sampling.top_k, vocab)[:, None]
    ordered = jnp.where(rank < top_k, ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # Keep a token while the mass of the tokens ranked above it is below top_p; the first always.
    keep = (mass_before < sampling.top_p[:, None]) | (rank == 0) | (sampling.top_p[:, None] >= 1.0)
    threshold = jnp.min(jnp.where(keep & (ordered > -jnp.inf), ordered, jnp.inf), axis=-1)
    return jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)


def row_keys(seeds: jax.Array, steps: jax.Array) -> jax.Array:
    """One PRNG key per row, from the row's seed and its step index."""
    return jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(seeds, steps)


def sample(logits: jax.Array, sampling: SamplingArrays, steps: jax.Array) -> jax.Array:
    """Logits [B, V] -> tokens [B] int32; `steps` [B] is each row's count of tokens drawn so far."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(logits: jax.Array) -> jax.Array:
        warped = warp_logits(logits, sampling)
        keys = row_keys(sampling.seeds, steps)
        drawn = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, warped)
        return jnp.where(sampling.temperature > 0, drawn.astype(jnp.int32), greedy)

    return jax.lax.cond(jnp.any(sampling.temperature > 0), draw, lambda _: greedy, logits)
