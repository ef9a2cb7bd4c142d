"""Sampling parameters, validated on the host, applied on device as per-row arrays.

Temperature, top-k, top-p and the PRNG key are arrays with one row per sequence, so a batch
mixes greedy and sampled requests and changing a value never recompiles. Each row draws with
`fold_in(key(seed), step)`: the tokens of a request depend on its seed and its own step count
only, never on what else shares the batch.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def is_integer(x: object) -> bool:
    """An int or numpy integer, but not a bool (True is an int in Python: max_tokens=True is a
    mistake, not 1 token)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _finite(x: numbers.Real) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int too large for a float
        return False


def _as_tuple(x: object, field: str) -> tuple:
    try:
        return tuple(x)
    except TypeError:
        raise ValueError(f"invalid SamplingParams: {field} must be a sequence, got {x!r}") from None


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """vLLM-style sampling parameters. temperature 0 is greedy; top_k 0 and top_p 1 disable them.

    seed None (the default) means a fresh seed per request, as in vLLM: two unseeded requests
    draw independent noise. The engine fixes it when the request is created
    (`with_resolved_seed`) and reports it on the output; an explicit seed reproduces.
    Numeric fields take Python or numpy numbers (stored as Python int / float), never bools.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            object.__setattr__(self, "stop", _as_tuple(self.stop, "stop"))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids"))
        problems = []
        if not (_real(self.temperature) and _finite(self.temperature) and self.temperature >= 0):
            problems.append(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (_real(self.top_p) and 0 < self.top_p <= 1):
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (is_integer(self.top_k) and self.top_k >= 0):
            problems.append(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if not (is_integer(self.max_tokens) and self.max_tokens >= 1):
            problems.append(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not (self.seed is None or (is_integer(self.seed) and 0 <= self.seed < 2**32)):
            problems.append(f"seed must be None (a fresh seed per request) or an int in "
                            f"[0, 2**32), got {self.seed!r}")
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            problems.append(f"stop must be non-empty strings, got {self.stop!r}")
        if not all(is_integer(t) and t >= 0 for t in self.stop_token_ids):
            problems.append(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            problems.append(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))
        # Plain Python values, so params hash, compare and serialize alike however they were
        # spelled (np.int64(5) == 5, but json.dumps rejects it).
        for name in ("top_k", "max_tokens") + (("seed",) if self.seed is not None else ()):
            object.__setattr__(self, name, int(getattr(self, name)))
        for name in ("temperature", "top_p"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_resolved_seed(self) -> "SamplingParams":
        """These params with a concrete seed: itself when seeded, else a copy with a fresh
        32-bit seed from the OS's entropy (not `random`, whose state a user may have seeded)."""
        if self.seed is not None:
            return self
        return dataclasses.replace(self, seed=secrets.randbits(32))


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
