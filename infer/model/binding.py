"""The one way infer hands a Flax module to jit: split the nnx graph once, pass the weights as a
flat list of arrays, merge them back inside the trace.

Handing jit the nnx module (or its graph as a static argument) made every call hash and
re-flatten it, about 4 ms of host time a step. With the structure closed over and the leaves as
arguments, a call costs what a call with plain arrays costs. The leaves are read once, when the
binding is made: later edits of the module are not seen by the programs built on it.

A program closes over the `Structure` alone, never over the arrays, so that one traced for a
module serves every module of the same structure (`infer.model.programs`) without keeping the
first one's weights alive.
"""

from __future__ import annotations

import dataclasses
from typing import Generic, Hashable, TypeVar

import jax
import numpy as np
from flax import nnx

M = TypeVar("M", bound=nnx.Module)


@dataclasses.dataclass(frozen=True)
class Structure(Generic[M]):
    """What rebuilds a module from its flat weights: the nnx graph (its static settings, the
    config among them) and the weights' tree. Hashable; holds no array."""

    graphdef: nnx.GraphDef
    treedef: jax.tree_util.PyTreeDef

    def bind(self, params: list[jax.Array]) -> M:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, params))


@dataclasses.dataclass(frozen=True)
class Binding(Generic[M]):
    """A module's weights (`params`, pass them to the jitted function) and `bind(params)`, which
    rebuilds the module from them inside the trace."""

    params: list[jax.Array]
    structure: Structure[M]

    def bind(self, params: list[jax.Array]) -> M:
        return self.structure.bind(params)

    @property
    def signature(self) -> Hashable:
        """What a program traced for these weights depends on: the structure, and each weight's
        `placement`. Equal signatures, equal programs (bfloat16 and float32 weights share a
        structure, not a signature)."""
        return self.structure, tuple(map(placement, self.params))


def placement(array: jax.Array | np.ndarray) -> Hashable:
    """What jit keys an argument's executable on: shape, dtype, sharding, and whether the array
    was put on its device explicitly (committed). Host arrays have no sharding: None."""
    return (array.shape, np.dtype(array.dtype), getattr(array, "sharding", None),
            getattr(array, "committed", False))


def committed_device(params: list[jax.Array]) -> jax.sharding.Sharding | None:
    """The one device weights were put on explicitly (committed), or None. A program over them
    takes every input there (`in_shardings`): inputs of either kind then share one executable,
    where jit would compile one per mix of committed and uncommitted arguments."""
    # By device, not by sharding: a data-parallel replica's weights sit on one device, each
    # with its own spec over that device's one-device mesh.
    devices = {d for p in params if getattr(p, "committed", False) for d in p.sharding.device_set}
    if len(devices) > 1:
        raise ValueError("weights committed to several devices without a mesh: place them "
                         "with infer.parallel.placement.place_model")
    return jax.sharding.SingleDeviceSharding(devices.pop()) if devices else None


def on_device(module: M, device: jax.sharding.Sharding) -> M:
    """The module with every weight on `device`, committed (arrays already there are kept)."""
    graphdef, state = nnx.split(module)
    return nnx.merge(graphdef, jax.device_put(state, device))


def binding(module: M) -> Binding[M]:
    """The module's binding: its weight arrays (not copied) and how to rebuild it from them."""
    graphdef, state = nnx.split(module)
    leaves, treedef = jax.tree.flatten(state)
    return Binding(params=leaves, structure=Structure(graphdef, treedef))
