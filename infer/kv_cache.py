"""KV caches as pytrees, and the per-step attention metadata that says where new tokens go.

Each cache class implements the same two operations, so the model never knows which one it
holds: `write(layer, k, v, meta)` stores the new tokens' keys and values and returns the new
cache, `attend(layer, q, meta)` runs attention of the new queries over the cached tokens.

Slots and positions are different things: a token's *slot* is its index in its sequence's cache
(0, 1, 2, ...), its *position* is what RoPE sees. They coincide except in tree speculation, where
siblings sit in consecutive slots but share a position.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import ArrayLike

from infer import attention


def check_writes(starts: ArrayLike, ends: ArrayLike, capacity: ArrayLike,
                 names: Sequence[str] | None = None) -> None:
    """Raises ValueError naming each row (and `names[row]`, e.g. its request) whose writes,
    slots [starts, ends) per row, do not lie in [0, capacity) (per row, or one for all); rows
    with ends <= starts write nothing.

    The one bounds check of every host caller that builds metadata (the runner, the proposers,
    the simple loop, tree speculation) and of eager cache writes. It must run on the host: the
    jitted write cannot raise, and out of range it drops (contiguous) or lands on another slot
    (a paged row's table is padded with page 0), silently either way."""
    starts, ends = np.asarray(starts).reshape(-1), np.asarray(ends).reshape(-1)
    capacity = np.broadcast_to(np.asarray(capacity), starts.shape)
    bad = np.flatnonzero((ends > starts) & ((starts < 0) | (ends > capacity)))
    if bad.size:
        label = lambda b: f"row {b}" + (f" ({names[b]})" if names is not None else "")
        rows = "; ".join(f"{label(b)} writes slots [{starts[b]}, {ends[b]}) but has room for "
                         f"{capacity[b]}" for b in bad[:8])
        more = f" (and {bad.size - 8} more rows)" if bad.size > 8 else ""
        raise ValueError(f"write outside the KV cache: {rows}{more}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """What one model call needs to know about the batch, as arrays (never static)."""

    positions: jax.Array  # [B, T] int32, RoPE positions of the new tokens
    lengths: jax.Array  # [B] int32, tokens in the cache after this call (old + new)
    q_lens: jax.Array  # [B] int32, valid new tokens of each row (<= T); the rest is padding
    page_tables: jax.Array | None = None  # [B, n] int32, paged caches only
    tree_mask: jax.Array | None = None  # [B, T, T] bool: new token i sees new token j

    @property
    def starts(self) -> jax.Array:
        """Slot of each row's first new token."""
        return self.lengths - self.q_lens

    def check_eager_writes(self, capacity: int) -> None:
        """`check_writes` of this call's new tokens against `capacity` slots per row, when the
        metadata holds values (an eager call). Under jit it holds tracers and checks nothing:
        jitted callers check first, on the host."""
        if isinstance(self.lengths, jax.core.Tracer):
            return
        lengths = np.asarray(self.lengths)
        check_writes(lengths - np.asarray(self.q_lens), lengths, capacity)

    def new_token_slots(self) -> tuple[jax.Array, jax.Array]:
        """[B, T] slot of each new token and [B, T] whether it is a real (non-padding) token."""
        t = jnp.arange(self.positions.shape[1], dtype=jnp.int32)
        slots = self.starts[:, None] + t[None, :]
        return slots, t[None, :] < self.q_lens[:, None]

    @staticmethod
    def for_prefill(q_lens: jax.Array, num_tokens: int, cached: jax.Array | None = None,
                    page_tables: jax.Array | None = None) -> "AttentionMetadata":
        """Rows of `num_tokens` (padded) new tokens following `cached` tokens already stored."""
        q_lens = jnp.asarray(q_lens, jnp.int32)
        cached = jnp.zeros_like(q_lens) if cached is None else jnp.asarray(cached, jnp.int32)
        positions = cached[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
        return AttentionMetadata(positions=positions, lengths=cached + q_lens, q_lens=q_lens,
                                 page_tables=page_tables)

    @staticmethod
    def for_decode(cached: jax.Array, page_tables: jax.Array | None = None) -> "AttentionMetadata":
        """One new token per row, after `cached` tokens."""
        cached = jnp.asarray(cached, jnp.int32)
        return AttentionMetadata(positions=cached[:, None], lengths=cached + 1,
                                 q_lens=jnp.ones_like(cached), page_tables=page_tables)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Contiguous cache: every sequence owns `max_len` slots; one head-major `[B, K, S, D]` array
    per layer for keys and one for values (logically `[L, B, K, S, D]`).

    Separate per-layer arrays, sized to what the batch needs now and grown by `resized` as it
    lengthens, let attention read a layer's keys in place: any slice of a larger array (a layer
    of a stacked cache, the used prefix of a max-length one) was copied by XLA:CPU before each
    product. Head-major: see `attention.masked_attention`.
    """

    k: tuple[jax.Array, ...]  # L x [B, K, S, D]
    v: tuple[jax.Array, ...]

    @staticmethod
    def create(num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
               dtype: jnp.dtype = jnp.float32) -> "KVCache":
        shape = (batch, num_kv_heads, max_len, head_dim)
        zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
        return KVCache(k=zeros(), v=zeros())

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def resized(self, max_len: int) -> "KVCache":
        """The same cache with room for `max_len` slots (existing slots kept, new ones zero)."""
        if max_len < self.max_len:
            raise ValueError(f"cannot shrink the cache from {self.max_len} to {max_len} slots")
        return _grow(self, max_len)

    def write(self, layer: int, k: jax.Array, v: jax.Array, meta: AttentionMetadata) -> "KVCache":
        """Stores the new tokens' keys and values. Slots past `max_len` raise when called eagerly;
        under jit they would be dropped, so jitted callers check first (`check_writes`)."""
        meta.check_eager_writes(self.max_len)
        slots, valid = meta.new_token_slots()
        slots = jnp.where(valid, slots, self.max_len)  # out of range: the scatter drops padding
        rows = jnp.broadcast_to(jnp.arange(k.shape[0])[:, None], slots.shape)
        # Advanced indices split by a slice: the scattered dims come first, [B, T, K, D].
        put = lambda cache, new: cache.at[rows, :, slots].set(new.astype(cache.dtype), mode="drop")
        new_k = self.k[:layer] + (put(self.k[layer], k),) + self.k[layer + 1:]
        new_v = self.v[:layer] + (put(self.v[layer], v),) + self.v[layer + 1:]
        return KVCache(k=new_k, v=new_v)

    def attend(self, layer: int, q: jax.Array, meta: AttentionMetadata) -> jax.Array:
        return attention.masked_attention(q, self.k[layer], self.v[layer],
                                          attention.visibility_mask(meta, self.max_len))


@functools.partial(jax.jit, static_argnums=1)  # no donation: the output is larger
def _grow(cache: KVCache, max_len: int) -> KVCache:
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, max_len - x.shape[2]), (0, 0)))
    return KVCache(k=tuple(map(pad, cache.k)), v=tuple(map(pad, cache.v)))
