"""Weights and KV pages onto a mesh, by the logical axes each parameter names.

`place_model` puts each weight straight from the host to the devices that hold its shards, so a
model too big for one device never passes through device 0 whole. Without a mesh it puts every
weight on the default device, the single-device case.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from infer.model.llama import Llama, is_tiled
from infer.model.sharding import DEFAULT_RULES, ShardingRules
from infer.parallel.heads import apply_head_layout, head_layout
from infer.parallel.mesh import ParallelConfig
from infer.platform import logger


def param_shardings(model: Llama, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES
                    ) -> list[NamedSharding]:
    """The sharding of each weight, in the order of `infer.model.binding`'s flat params."""
    return _shardings(nnx.split(model)[1], mesh, rules)


def _shardings(state: nnx.State, mesh: Mesh, rules: ShardingRules) -> list[NamedSharding]:
    variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return [NamedSharding(mesh, rules.spec(v.get_metadata()["logical_axes"]))
            for v in variables]


def place_model(model: Llama, mesh: Mesh | None, rules: ShardingRules = DEFAULT_RULES) -> Llama:
    """The model with every weight on the mesh (sharded by its logical axes), or on the default
    device without a mesh. Weights may be numpy arrays or jax arrays anywhere."""
    if mesh is not None:
        _check_untiled(model)
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    if mesh is None:
        placed = [jax.device_put(leaf) for leaf in leaves]
    else:
        placed = [jax.device_put(leaf, sharding)
                  for leaf, sharding in zip(leaves, _shardings(state, mesh, rules))]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, placed))


def _check_untiled(model: Llama) -> None:
    if is_tiled(model):
        # The logical axes (and a head layout) name an [in, out] weight's two dims, not a packed
        # layout's three or four.
        raise ValueError("this model's projections are in the CPU kernel's tile layout "
                         "(`tile_weights`, for one device): place the model as loaded")


def bytes_per_device(arrays: list[jax.Array]) -> dict[jax.Device, int]:
    """Bytes each device holds of `arrays` (shards, replicas counted once per device)."""
    held: dict[jax.Device, int] = {}
    for array in arrays:
        for shard in array.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + int(np.prod(shard.data.shape)
                                                                 * array.dtype.itemsize)
    return held




def place_replicas(model: Llama, parallel: ParallelConfig,
                   devices: Sequence[jax.Device] | None = None
                   ) -> list[tuple[Llama, Mesh | None]]:
    """(model, mesh) per data-parallel replica: heads laid out for the tensor-parallel size
    (`infer.parallel.heads`, checked before any weight moves), then placed on the replica's
    mesh. One device: the model on the default device, no mesh."""
    if parallel.is_single_device:
        return [(place_model(model, None), None)]
    meshes = parallel.replica_meshes(devices)  # too few devices fails here, before any copy
    _check_untiled(model)  # before a head layout reshapes its packed weights
    layout = head_layout(model.config, parallel.tensor_parallel_size, parallel.pad_heads)
    if layout.way != "split":
        logger().info("tensor_parallel_size=%d: heads %s", parallel.tensor_parallel_size,
                      layout.describe(model.config))
    laid_out = apply_head_layout(model, layout)
    return [(place_model(laid_out, mesh), mesh) for mesh in meshes]
