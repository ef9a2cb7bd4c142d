"""Sharding rules as data, and a `shard()` that constrains layouts only under a mesh.

Parameters and activations name their dimensions with logical axes ("embed", "heads", ...).
`ShardingRules` maps logical axes to the axes of a `jax.sharding.Mesh`. With no mesh active
(the CPU default) `shard()` returns its input untouched, so single-device code pays nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence, TypeVar

import jax
from jax.sharding import PartitionSpec

T = TypeVar("T")

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
        axes = [table[a] if a is not None else None for a in logical_axes]
        # Trailing replicated dims dropped: the form XLA gives back for a program's outputs, so
        # an array passed through a step keeps a sharding equal to (not merely equivalent to)
        # the one it came with, and the step's next call hits the same compiled program.
        while axes and axes[-1] is None:
            axes.pop()
        return PartitionSpec(*axes)


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


def replicate(x: T) -> T:
    """Constrains the arrays of `x` to be whole on every device of the active mesh (sampled
    tokens, which every device's next step reads); no-op without one."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec())


def per_shard(fn: Callable[..., jax.Array], in_axes: Sequence[Sequence[str | None] | None],
              out_axes: Sequence[str | None], rules: ShardingRules = DEFAULT_RULES
              ) -> Callable[..., jax.Array]:
    """`fn` run on each device's shards of its arguments under the active mesh (`jax.shard_map`),
    for code that must see local blocks, as a Pallas kernel does: under plain jit a kernel over
    sharded inputs would all-gather them first. `in_axes` gives each argument's logical axes
    (a prefix for every array in it; None: replicated). Without a mesh, `fn` itself."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return fn
    specs = tuple(PartitionSpec() if a is None else rules.spec(a) for a in in_axes)
    # check_vma off: Pallas calls do not declare how their outputs vary across devices.
    return jax.shard_map(fn, in_specs=specs, out_specs=rules.spec(out_axes), check_vma=False)
