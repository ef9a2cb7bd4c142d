"""Named tensors of an nnx module, and their safetensors files (bfloat16 on disk, no pickle): how
the trained draft model and EAGLE head are saved and loaded."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from infer.model.config import LlamaConfig


def path_name(path: tuple) -> str:
    return ".".join(str(p) for p in path)

def named_params(module: nnx.Module, skip: Callable[[str], bool] = lambda name: False
                 ) -> dict[str, jax.Array]:
    """{"layers.0.attn.q_proj": array, ...}: every nnx.Param of `module` by dotted path, except
    the names `skip` rejects. The arrays are the module's own (no copy)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        name = path_name(path)
        if not skip(name):
            out[name] = var.get_value()
    return out

def assign_params(module: nnx.Module, tensors: Mapping[str, jax.Array | np.ndarray],
                  dtype: jnp.dtype | None = None, strict: bool = True) -> None:
    """Sets the module's parameters from named tensors (cast to `dtype` when given, otherwise
    assigned as they are: the same arrays). Shapes must match; with `strict`, every name must
    exist in the module and every tensor must be used. Raises ValueError naming the problem."""
    params = {path_name(p): v for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}
    unknown = sorted(set(tensors) - set(params))
    if strict and unknown:
        raise ValueError(f"tensors {unknown[:5]} have no parameter in {type(module).__name__}")
    for name, value in tensors.items():
        if name not in params:
            continue
        var = params[name]
        want = tuple(var.get_value().shape)
        if tuple(value.shape) != want:
            raise ValueError(f"tensor {name!r} has shape {tuple(value.shape)}, the parameter "
                             f"expects {want}")
        if dtype is not None or not isinstance(value, jax.Array):
            value = jnp.asarray(value, dtype=dtype or var.get_value().dtype)
        var.set_value(value)

def config_metadata(config: LlamaConfig) -> str:
    return json.dumps(dataclasses.asdict(config))

def save_tensors(tensors: Mapping[str, jax.Array], path: str | os.PathLike[str],
                 metadata: Mapping[str, str]) -> int:
    """Writes named tensors as bfloat16 safetensors (no pickle). Returns the file's size."""
    from safetensors.numpy import save_file

    arrays = {name: np.asarray(jnp.asarray(x, jnp.bfloat16)).astype(ml_dtypes.bfloat16)
              for name, x in tensors.items()}
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file(arrays, path, metadata=dict(metadata))
    return os.path.getsize(path)

def read_tensors(path: str | os.PathLike[str]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(named tensors as stored, metadata) of a safetensors file."""
    from safetensors import safe_open

    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"weights file {path!r} does not exist")
    with safe_open(path, framework="numpy") as f:
        metadata = f.metadata() or {}
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    return tensors, metadata

def check_format(metadata: Mapping[str, str], fmt: str, path: str) -> None:
    if metadata.get("format") != fmt:
        raise ValueError(f"{path!r} is not an {fmt} file (format={metadata.get('format')!r})")
