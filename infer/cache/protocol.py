"""What the model asks of a KV cache: three operations, so it never knows which cache it holds.

  write(layer, k, v, meta)                 store the new tokens' keys and values; the new cache
  attend(layer, q, meta)                   attention of the new queries over the cached tokens
  write_and_attend(layer, q, k, v, meta)   both, as one layer of a step runs them: (cache, out)

The model calls write_and_attend. For every cache but one it is write, then attend over what was
written (`WriteThenAttend`). The exception stores tokens lossily but lets the step that wrote
them read them exactly (int4_kivi, as KIVI computes a prompt's attention in full precision and
quantizes what it keeps), which a separate write and attend cannot express: the exact values are
gone once written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeVar

import jax

if TYPE_CHECKING:
    from infer.cache.metadata import AttentionMetadata

CacheT = TypeVar("CacheT", bound="KVCacheLike")


class KVCacheLike(Protocol):
    def write(self: CacheT, layer: int, k: jax.Array, v: jax.Array,
              meta: "AttentionMetadata") -> CacheT: ...

    def attend(self, layer: int, q: jax.Array, meta: "AttentionMetadata") -> jax.Array: ...

    def write_and_attend(self: CacheT, layer: int, q: jax.Array, k: jax.Array, v: jax.Array,
                         meta: "AttentionMetadata") -> tuple[CacheT, jax.Array]: ...


class WriteThenAttend:
    """write_and_attend as write, then attend: the new queries read their own tokens as the
    cache stores them."""

    def write_and_attend(self: CacheT, layer: int, q: jax.Array, k: jax.Array, v: jax.Array,
                         meta: "AttentionMetadata") -> tuple[CacheT, jax.Array]:
        cache = self.write(layer, k, v, meta)
        return cache, cache.attend(layer, q, meta)
