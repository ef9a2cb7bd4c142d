"""Sampling on device: parameters as per-row arrays, the one warp of the logits, the one draw, and
every PRNG key rule.

Temperature, top-k, top-p and the seed are arrays with one row per sequence, so a batch mixes
greedy and sampled requests and changing a value never recompiles. Every key is derived from a
row's seed and its `sample_index` (the tokens sampled for the request so far) by a rule of
this module, so a request's randomness depends on its seed and its own progress only, never on
what else shares the batch, and the streams of different uses never share a key:

  stream        key of row b                                        used for
  ------------  --------------------------------------------------  ------------------------------
  token         fold_in(key(seed), sample_index)                    `sample`: plain decoding's
                                                                    token `sample_index`
  draft         fold_in(fold_in(key(seed ^ DRAFT_SALT),             a proposer's draft `draft` in
                        sample_index), draft)                       the step that emits token
                                                                    `sample_index` first
  verify        fold_in(fold_in(key(seed), sample_index),           the verifier's draw (chain or
                        VERIFY_SALT)                                tree) in that step

The token stream is the one plain sampling has always used: changing it would change every
seeded output. The verify stream folds a salt into the token key of the same index, and the
draft stream starts from a salted seed, so neither ever equals a token key of the same request.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from infer.sampling_params import MAX_LOGPROBS, SamplingParams


_INT32_MAX = int(np.iinfo(np.int32).max)
# The largest temperature the device sees. A finite one past float32's range became inf there,
# and a token a structured-output mask set to -inf then had logit -inf / inf = NaN, which the
# draw took for token 0 whatever the mask allowed; an inf temperature also sent every logit to
# 0, so top-k kept the whole vocabulary as ties. Past 1e30 the clamp changes no probability
# (logit gaps over 1e30 make every exp 1 in float32), and logits over it keep their order (a
# logit of magnitude 1e-8 or more stays a normal float).
_MAX_TEMPERATURE = 1e30


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling parameters on device.

    Two parts change the program rather than its inputs, so that a batch asking for neither
    compiles and runs exactly as if they did not exist: `allowed`, a structured-output bitmask
    (None: no row is constrained, and the program has no mask), and `num_logprobs` (static: 0,
    or the MAX_LOGPROBS top logprobs a step then also returns)."""

    temperature: jax.Array  # [B] float32, 0 = greedy (`SamplingParams.greedy`)
    top_k: jax.Array  # [B] int32, 0 = off
    top_p: jax.Array  # [B] float32, 1 = off
    seeds: jax.Array  # [B] uint32
    # [B, ceil(V / 32)] int32: bit t % 32 of word t // 32 set = token t may be sampled.
    allowed: jax.Array | None = None
    num_logprobs: int = dataclasses.field(default=0, metadata=dict(static=True))

    @staticmethod
    def from_params(params: Sequence[SamplingParams], batch: int | None = None,
                    allowed: np.ndarray | None = None) -> "SamplingArrays":
        """Rows for `params`, padded with greedy rows up to `batch`. Every seed must be concrete:
        resolve unseeded params first (`SamplingParams.with_resolved_seed`), once per request,
        so its draws stay one stream across steps. `allowed`: the rows' bitmask [batch, words]
        when some row is constrained (an unconstrained row's is all ones)."""
        batch = len(params) if batch is None else batch
        if allowed is not None and (allowed.dtype != np.int32 or allowed.ndim != 2
                                    or allowed.shape[0] != batch):
            raise ValueError(f"allowed must be an int32 bitmask [{batch}, words], got "
                             f"{allowed.dtype} {allowed.shape}")
        if len(params) > batch:
            raise ValueError(f"{len(params)} sampling params for a batch of {batch}")
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            raise ValueError(f"sampling params of rows {unseeded} have seed=None; resolve each "
                             "request's seed once with SamplingParams.with_resolved_seed() first")
        pad = [SamplingParams(seed=0)] * (batch - len(params))
        rows = list(params) + pad
        # Built on the host and moved in one device_put: an eager jnp.asarray per field ran a
        # conversion program of its own, four per engine step. A top_k past int32 restricts
        # nothing, as does one of the vocabulary's size: clamped, it cannot fail the batch. A
        # temperature is clamped too (`_MAX_TEMPERATURE`).
        return jax.device_put(SamplingArrays(
            temperature=np.asarray([0.0 if p.greedy else min(p.temperature, _MAX_TEMPERATURE)
                                    for p in rows], np.float32),
            top_k=np.asarray([min(p.top_k, _INT32_MAX) for p in rows], np.int32),
            top_p=np.asarray([p.top_p for p in rows], np.float32),
            seeds=np.asarray([p.seed for p in rows], np.uint32),
            allowed=allowed,
            num_logprobs=MAX_LOGPROBS if any(p.logprobs is not None for p in params) else 0,
        ))


def constrain(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """Logits [B, V] with every token outside its row's bitmask [B, ceil(V/32)] at -inf."""
    bits = jnp.arange(32, dtype=jnp.int32)
    unpacked = (jax.lax.shift_right_logical(allowed[:, :, None], bits[None, None, :]) & 1) > 0
    keep = unpacked.reshape(allowed.shape[0], -1)[:, :logits.shape[-1]]
    return jnp.where(keep, logits, -jnp.inf)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleLogprobs:
    """Per row, under the model's raw distribution log_softmax(logits): the sampled token's
    logprob and rank (1 = the most likely), and the `num_logprobs` most likely tokens."""

    logprob: jax.Array  # [B] float32
    rank: jax.Array  # [B] int32
    top_ids: jax.Array  # [B, K] int32, most likely first (K = min(num_logprobs, V))
    top_logprobs: jax.Array  # [B, K] float32


def sample_logprobs(logits: jax.Array, tokens: jax.Array, num_logprobs: int) -> SampleLogprobs:
    """The logprobs of `tokens` [B] drawn from `logits` [B, V], and the top `num_logprobs`
    (every token, when the vocabulary holds fewer)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    # vLLM's count: tokens at least as likely, the chosen one included (ties rank below it).
    rank = jnp.maximum(1, jnp.sum(logp >= chosen[:, None], axis=-1, dtype=jnp.int32))
    # The logprobs variant asks for MAX_LOGPROBS whatever the model: top_k past V fails the step.
    top_logprobs, top_ids = jax.lax.top_k(logp, min(num_logprobs, logp.shape[-1]))
    return SampleLogprobs(chosen, rank, top_ids.astype(jnp.int32), top_logprobs)


def argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` as int32, the same index for every input (ties and NaNs: the
    first). On CPU as a max, then the first index holding it: XLA:CPU runs argmax's (value,
    index) reduction element by element, 0.28 ms over SmolLM2's 49,152 logits and 1.3 ms over
    five rows of them (a verify step's k + 1 = 5), against 0.10 and 0.24 ms for the two
    vectorized reductions; elsewhere argmax itself."""
    if jax.default_backend() != "cpu":
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    top = jnp.max(x, axis=-1, keepdims=True)  # NaN when the row holds one, as argmax takes it
    hit = (x == top) | (jnp.isnan(x) & jnp.isnan(top))
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1)


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
    top_k = jnp.minimum(jnp.where(sampling.top_k > 0, sampling.top_k, vocab), vocab)[:, None]
    # Top-k keeps every token tied with the k-th (as vLLM's mask by value does), so the nucleus
    # below is measured over all of them, not over k of them.
    kth = jnp.take_along_axis(ordered, top_k - 1, axis=-1)
    ordered = jnp.where(ordered >= kth, ordered, -jnp.inf)
    probs = jax.nn.softmax(ordered, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # Keep a token while the mass of the tokens ranked above it is below top_p; the first always.
    keep = (mass_before < sampling.top_p[:, None]) | (rank == 0) | (sampling.top_p[:, None] >= 1.0)
    threshold = jnp.min(jnp.where(keep & (ordered > -jnp.inf), ordered, jnp.inf), axis=-1)
    return jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf)


def sampling_probs(logits: jax.Array, sampling: SamplingArrays) -> jax.Array:
    """Each row's sampling distribution, softmax(warp_logits), for logits [B, V] or [B, T, V]
    (every position of a row warped with the row's parameters): a verifier's target p."""
    if sampling.allowed is not None:
        raise ValueError("a structured-output mask holds for one position, not for the drafts "
                         "a verifier scores: constrained rows decode without speculation")
    if logits.ndim == 2:
        return jax.nn.softmax(warp_logits(logits, sampling), axis=-1)
    b, t, v = logits.shape
    rows = jax.tree.map(lambda a: jnp.repeat(a, t, axis=0), sampling)
    return jax.nn.softmax(warp_logits(logits.reshape(b * t, v), rows), axis=-1).reshape(b, t, v)


def draw(logits: jax.Array, sampling: SamplingArrays, keys: jax.Array, with_probs: bool = False
         ) -> tuple[jax.Array, jax.Array | None]:
    """Tokens [B] int32 from logits [B, V]: the argmax for greedy rows, a draw with `keys` [B]
    from the row's warped distribution otherwise. With `with_probs` (static), also that
    distribution [B, V] (a proposer hands it to the verifier as q; a greedy row's is unused),
    else None.

    Without `with_probs`, a batch whose rows are all greedy skips the warp and the draw at run
    time (`lax.cond`): this is the timed decode step's sampler, and greedy is its common case.
    With a bitmask (`sampling.allowed`), every row draws among its allowed tokens only."""
    if sampling.allowed is not None:
        logits = constrain(logits, sampling.allowed)
    greedy = argmax(logits)

    def sampled(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
        warped = warp_logits(logits, sampling)
        drawn = inverse_cdf_draw(keys, warped)
        return jnp.where(sampling.temperature > 0, drawn, greedy), warped

    if with_probs:
        tokens, warped = sampled(logits)
        return tokens, jax.nn.softmax(warped, axis=-1)
    tokens = jax.lax.cond(jnp.any(sampling.temperature > 0), lambda x: sampled(x)[0],
                          lambda _: greedy, logits)
    return tokens, None


def inverse_cdf_draw(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """A draw [B] int32 from softmax(logits [B, V]) per row, with one uniform per row (from
    `keys` [B]): `inverse_cdf_pick`. Gumbel-max (`jax.random.categorical`) takes V random
    numbers per row instead, and on CPU those threefry draws cost more than the rest of a
    sampled step's sampling (64 rows of SmolLM2's 49,152 ids: 26 ms against 66 ms,
    `experiments.sampler_cost` on a quiet machine)."""
    u = jax.vmap(lambda key: jax.random.uniform(key, ()))(keys)
    return inverse_cdf_pick(u, jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)))


def inverse_cdf_pick(u: jax.Array, weights: jax.Array) -> jax.Array:
    """The id [...] int32 drawn with probability weights / sum(weights) over the last axis of
    `weights` [..., V] (non-negative, unnormalized) by the uniform `u` [...] in [0, 1): the
    first id whose running sum exceeds u * total. Ids of weight 0 are never drawn: their
    running sum equals the one before them; a draw that float rounding puts on one takes the
    heaviest id instead. The float32 uniform and running sum resolve about 2^-23 of the total:
    an id lighter than that may never be drawn, which matters on flat rows over a large
    vocabulary (most of their ids are that light; a review's enumeration over every uniform,
    not kept, put the total variation near 1e-3 there). A Gumbel race has no such floor but
    costs V random numbers a row."""
    running = jnp.cumsum(weights, axis=-1)
    threshold = (u * running[..., -1])[..., None]
    drawn = jnp.minimum(jnp.sum(running <= threshold, axis=-1), weights.shape[-1] - 1)
    possible = jnp.take_along_axis(weights, drawn[..., None], axis=-1)[..., 0] > 0
    return jnp.where(possible, drawn, argmax(weights)).astype(jnp.int32)


def sample(logits: jax.Array, sampling: SamplingArrays, sample_index: jax.Array) -> jax.Array:
    """Logits [B, V] -> tokens [B] int32 from the token stream; `sample_index` [B] is each row's
    count of tokens sampled so far."""
    return draw(logits, sampling, token_keys(sampling.seeds, sample_index))[0]


# -- the key rules (see the table above) -------------------------------------------------------

DRAFT_SALT = 0xD4AF7  # xor-ed into the seed: the draft stream's own root key
VERIFY_SALT = 0x5EC  # folded into the token key of the step's first emitted index


def token_keys(seeds: jax.Array, sample_index: jax.Array) -> jax.Array:
    """Keys [B] of the token stream: row b's token number sample_index[b]."""
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, sample_index)


def draft_keys(seeds: jax.Array, sample_index: jax.Array, draft: int | jax.Array) -> jax.Array:
    """Keys [B] of the draft stream: draft number `draft` (0-based) of the step whose first
    emitted token is row b's sample_index[b]."""
    rows = token_keys(seeds ^ jnp.uint32(DRAFT_SALT), sample_index)
    return jax.vmap(jax.random.fold_in, (0, None))(rows, draft)


def verify_keys(seeds: jax.Array, sample_index: jax.Array) -> jax.Array:
    """Keys [B] of the verify stream: the verifier's one draw in the step whose first emitted
    token is row b's sample_index[b]."""
    return jax.vmap(lambda k: jax.random.fold_in(k, VERIFY_SALT))(token_keys(seeds, sample_index))
