"""KV caches as pytrees, and the per-step attention metadata that says where new tokens go.

Each cache class implements the same operations (`infer.cache.protocol`), so the model never
knows which one it holds: `write(layer, k, v, meta)` stores the new tokens' keys and values and
returns the new cache, `attend(layer, q, meta)` runs attention of the new queries over the cached
tokens.

Slots and positions are different things: a token's *slot* is its index in its sequence's cache
(0, 1, 2, ...), its *position* is what RoPE sees. They coincide except in tree speculation, where
siblings sit in consecutive slots but share a position.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from infer.cache import attention
from infer.cache.metadata import AttentionMetadata
from infer.cache.protocol import WriteThenAttend
from kernels_pallas import kv_quant


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache(WriteThenAttend):
    """Contiguous cache: every sequence owns `max_len` slots; one head-major `[B, K, S, D]` array
    per layer for keys and one for values (logically `[L, B, K, S, D]`).

    Separate per-layer arrays, sized to what the batch needs now and grown by `resized` as it
    lengthens, let attention read a layer's keys in place: any slice of a larger array (a layer
    of a stacked cache, the used prefix of a max-length one) was copied by XLA:CPU before each
    product. Head-major: see `attention.masked_attention`.
    """

    k: tuple[jax.Array, ...]  # L x [B, K, S, D], in kv_quant.bits_dtype(dtype)
    v: tuple[jax.Array, ...]
    dtype: str = dataclasses.field(default="float32", metadata=dict(static=True))

    @staticmethod
    def create(num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
               dtype: jnp.dtype = jnp.float32) -> "KVCache":
        if jnp.dtype(dtype).name not in kv_quant.UNSCALED_FORMATS:
            # It stores keys as they are: an int8 or float8 cache would truncate or saturate
            # them (0.13 -> 0, 473 -> NaN in e4m3) with no scale to undo it.
            raise ValueError(f"the contiguous cache holds {', '.join(kv_quant.UNSCALED_FORMATS)}"
                             f", got {jnp.dtype(dtype).name} (quantized formats: PagedKVCache)")
        shape = (batch, num_kv_heads, max_len, head_dim)
        held = kv_quant.bits_dtype(dtype)
        zeros = lambda: tuple(jnp.zeros(shape, held) for _ in range(num_layers))
        return KVCache(k=zeros(), v=zeros(), dtype=jnp.dtype(dtype).name)

    def layer(self, layer: int) -> tuple[jax.Array, jax.Array]:
        """Layer `layer`'s keys and values in the cache's dtype (it may hold their bits)."""
        return (kv_quant.from_bits(self.k[layer], self.dtype),
                kv_quant.from_bits(self.v[layer], self.dtype))

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
        put = lambda cache, new: cache.at[rows, :, slots].set(
            kv_quant.to_bits(new.astype(self.dtype), cache.dtype), mode="drop")
        new_k = self.k[:layer] + (put(self.k[layer], k),) + self.k[layer + 1:]
        new_v = self.v[:layer] + (put(self.v[layer], v),) + self.v[layer + 1:]
        return dataclasses.replace(self, k=new_k, v=new_v)

    def move_tokens(self, page_tables: None, src: jax.Array, dst: jax.Array, valid: jax.Array
                    ) -> "KVCache":
        """`PagedKVCache.move_tokens` for row b's own slots (no page tables: pass None): where
        valid, slot src[b, t]'s keys and values are copied to dst[b, t] in every layer, all
        gathered before any is written; slots outside [0, max_len) write nothing."""
        del page_tables  # a contiguous row's slots are its positions
        inside = lambda slots: (slots >= 0) & (slots < self.max_len)
        ok = valid & inside(src) & inside(dst)
        source = jnp.clip(src, 0, self.max_len - 1)[:, None, :, None]
        target = jnp.where(ok, dst, self.max_len)
        rows = jnp.broadcast_to(jnp.arange(src.shape[0])[:, None], src.shape)
        # Advanced indices split by a slice: the scattered dims come first, [B, T, K, D].
        move = lambda x: x.at[rows, :, target].set(
            jnp.take_along_axis(x, source, axis=2).transpose(0, 2, 1, 3), mode="drop")
        return dataclasses.replace(self, k=tuple(map(move, self.k)), v=tuple(map(move, self.v)))

    def attend(self, layer: int, q: jax.Array, meta: AttentionMetadata) -> jax.Array:
        k, v = self.layer(layer)
        return attention.masked_attention(q, k, v, attention.visibility_mask(meta, self.max_len))


@functools.partial(jax.jit, static_argnums=1)  # no donation: the output is larger
def _grow(cache: KVCache, max_len: int) -> KVCache:
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, max_len - x.shape[2]), (0, 0)))
    return dataclasses.replace(cache, k=tuple(map(pad, cache.k)), v=tuple(map(pad, cache.v)))
