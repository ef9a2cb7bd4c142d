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

import jax
import jax.numpy as jnp

from infer import attention


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
    """Contiguous cache: every sequence owns `max_len` slots, head-major `[L, B, K, S, D]`
    (see `attention.masked_attention` for why head-major).

    `attend_len` (static) bounds the slots attention reads: with most sequences far shorter than
    `max_len`, reading all S slots every decode step would dominate its memory traffic.
    """

    k: jax.Array  # [L, B, K, S, D]
    v: jax.Array  # [L, B, K, S, D]
    attend_len: int = dataclasses.field(default=0, metadata=dict(static=True))

    @staticmethod
    def create(num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
               dtype: jnp.dtype = jnp.float32) -> "KVCache":
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), attend_len=max_len)

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def with_attend_len(self, attend_len: int) -> "KVCache":
        if not 0 < attend_len <= self.max_len:
            raise ValueError(f"attend_len {attend_len} outside (0, max_len={self.max_len}]")
        return dataclasses.replace(self, attend_len=attend_len)

    def write(self, layer: int, k: jax.Array, v: jax.Array, meta: AttentionMetadata) -> "KVCache":
        slots, valid = meta.new_token_slots()
        slots = jnp.where(valid, slots, self.max_len)  # out of range: the scatter drops padding
        rows = jnp.broadcast_to(jnp.arange(k.shape[0])[:, None], slots.shape)
        # Advanced indices split by a slice: the scattered dims come first, [B, T, K, D].
        new_k = self.k.at[layer, rows, :, slots].set(k.astype(self.k.dtype), mode="drop")
        new_v = self.v.at[layer, rows, :, slots].set(v.astype(self.v.dtype), mode="drop")
        return dataclasses.replace(self, k=new_k, v=new_v)

    def attend(self, layer: int, q: jax.Array, meta: AttentionMetadata) -> jax.Array:
        n = self.attend_len or self.max_len
        return attention.masked_attention(q, self.k[layer, :, :, :n], self.v[layer, :, :, :n],
                                          attention.visibility_mask(meta, n))
