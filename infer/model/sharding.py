"""Sharding rules as data, and a `shard()` that constrains layouts only under a mesh.

Parameters and activations name their dimensions with logical axes ("embed", "heads", ...).
`ShardingRules` maps logical axes to the axes of a `jax.sharding.Mesh`. With no mesh active
(the CPU default) `shard()` returns its input untouched, so single-device code pays nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
from jax.sharding import PartitionSpec

# One name per kind of dimension, shared by parameters (via the `logical_axes` metadata of
# each nnx.Param) and activations.
BATCH, SEQ, EMBED, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, LAYERS = (
    "batch", "seq", "embed", "heads", "kv_heads", "head_dim", "ffn", "vocab", "layers")


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis → mesh axis (None: replicated). Megatron-style tensor parallelism by default:
    heads and the FFN dimension split over "model", the batch over "data"."""

    rules: tuple[tuple[str, str | None], ...] = (
        (BATCH, "data"), (SEQ, None), (EMBED, None), (HEADS, "model"), (KV_HEADS, "model"),
        (HEAD_DIM, None), (FFN, "model"), (VOCAB, "model"), (LAYERS, None),
    )

    def spec(self, logical_axes: Sequence[str | None]) -> PartitionSpec:
        table = dict(self.rules)
        unknown = [a for a in logical_axes if a is not None and a not in table]
        if unknown:
            raise ValueError(f"no sharding rule for logical axes {unknown}; rules: {self.rules}")
        return PartitionSpec(*(table[a] if a is not None else None for a in logical_axes))


DEFAULT_RULES = ShardingRules()


def shard(x: jax.Array, logical_axes: Sequence[str | None],
          rules: ShardingRules = DEFAULT_RULES) -> jax.Array:
    """Constrains `x` to the layout its logical axes map to under the active mesh; no-op without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    if len(logical_axes) != x.ndim:
        raise ValueError(f"shard: {len(logical_axes)} logical axes for an array of shape {x.shape}")
    return jax.lax.with_sharding_constraint(x, rules.spec(logical_axes))
