"""The exact joint law of a request's first tokens under plain sampling, and a chi-square
goodness of fit against it: the shared check that a speculative method (engine or tree) keeps
the target's distribution."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from infer.cache.contiguous import KVCache
from infer.cache.metadata import AttentionMetadata
from infer.model.llama import Llama
from infer.sampling import SamplingArrays, warp_logits
from infer.sampling_params import SamplingParams


def exact_joint(model: Llama, prompt: list[int], params: SamplingParams, depth: int
                ) -> dict[tuple[int, ...], float]:
    """P(first `depth` tokens) of plain sampling, one dense forward per prefix in the support."""
    rows = params.top_k ** (depth - 1)  # the most prefixes a level can have
    length = len(prompt) + depth - 1
    c = model.config

    @jax.jit  # one shape for every level: eagerly, each op compiles anew per shape (~15 s here)
    def next_token_probs(tokens: jax.Array, lens: jax.Array) -> tuple[jax.Array, jax.Array]:
        cache = KVCache.create(c.num_layers, rows, length, c.num_kv_heads, c.head_dim)
        logits, _, _ = model(tokens, cache, AttentionMetadata.for_prefill(lens, length))
        logits = logits[jnp.arange(rows), lens - 1]
        sampling = SamplingArrays.from_params([params] * rows)
        return jax.nn.softmax(warp_logits(logits, sampling), axis=-1), logits

    law = {(): 1.0}
    for _ in range(depth):
        prefixes = list(law)
        tokens = np.zeros((rows, length), np.int32)
        lens = np.ones(rows, np.int32)
        for i, p in enumerate(prefixes):
            seq = prompt + list(p)
            tokens[i, :len(seq)], lens[i] = seq, len(seq)
        probs, logits = next_token_probs(jnp.asarray(tokens), jnp.asarray(lens))
        probs, logits = np.asarray(probs, np.float64), np.asarray(logits)[:len(prefixes)]
        assert_top_p_not_borderline(logits, params)
        law = {p + (int(t),): law[p] * probs[i, t]
               for i, p in enumerate(prefixes) for t in np.flatnonzero(probs[i])}
    return law


def assert_top_p_not_borderline(logits: np.ndarray, params: SamplingParams) -> None:
    """The engine's paged forward differs from the dense one here by float noise: a top-p cut
    this close to a boundary could fall the other way there."""
    scaled = logits.astype(np.float64) / params.temperature
    top = np.sort(scaled, axis=-1)[:, ::-1][:, :params.top_k]
    top = np.exp(top - top[:, :1])
    top /= top.sum(axis=-1, keepdims=True)
    mass_before = np.cumsum(top, axis=-1) - top
    assert np.abs(mass_before - params.top_p).min() > 1e-4


def chi_square_pvalue(counts: collections.Counter, law: dict[tuple[int, ...], float]) -> float:
    """Goodness of fit; outcomes expected fewer than 5 times are pooled into one cell (about 28
    expected here), with any outcome the law gives probability 0."""
    n = sum(counts.values())
    total = sum(law.values())
    expected = {k: n * v / total for k, v in law.items()}
    big = [k for k, e in expected.items() if e >= 5]
    obs = [counts.get(k, 0) for k in big]
    exp = [expected[k] for k in big]
    rest_obs = n - sum(obs)
    rest_exp = n - sum(exp)
    if rest_exp > 0 or rest_obs > 0:
        # An outcome outside the support with nothing expected there cannot be scored by
        # chi-square; give it an expectation so small that one sighting fails the test.
        obs.append(rest_obs)
        exp.append(max(rest_exp, 1e-9))
    return float(stats.chisquare(obs, exp).pvalue)
