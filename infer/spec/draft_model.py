"""Draft models that speak the target's tokenizer, for speculative decoding.

- `self_draft(target, n)`: the target's first n layers with its final norm and LM head (early
  exit), sharing the target's weight arrays: no training, no new weight memory.
- `draft_config(target_config)` (alias `DRAFT_CONFIG`): a small distilled draft of the target's
  width, 2 decoder layers by default, so it can borrow the target's (tied) embedding and head:
  about 7M parameters of its own for SmolLM2-135M. `experiments/train_draft.py` distils it.
- `save_draft` / `load_draft`: only the draft's own weights (layers + final norm) go to disk, as
  bfloat16 safetensors; the embedding and LM head are taken from the target on load.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
from flax import nnx

from infer.io.tensors import (assign_params, check_format, config_metadata, named_params,
                              read_tensors, save_tensors)
from infer.model.config import LlamaConfig
from infer.model.llama import Llama

DRAFT_FORMAT = "infer-draft-v1"
SHARED = ("embed", "lm_head")  # the draft's parameters that belong to the target


def _is_shared(name: str) -> bool:
    return name in SHARED


def _weight_dtype(target: Llama) -> jnp.dtype:
    return target.embed.get_value().dtype


def _shell(config: LlamaConfig, dtype: jnp.dtype) -> Llama:
    """A Llama of `config` whose parameters are shapes only (no memory) until assigned."""
    return nnx.eval_shape(lambda: Llama(config, dtype))


def self_draft(target: Llama, num_layers: int) -> Llama:
    """The target's first `num_layers` layers, final norm and head, as a Llama of
    `config.replace(num_layers=num_layers)` holding the target's own arrays (no copy), in the
    layout the target holds them (`tile_weights`' included)."""
    n_target = target.config.num_layers
    if not 1 <= num_layers <= n_target:
        raise ValueError(f"self_draft needs 1 <= num_layers <= {n_target}, got {num_layers}")
    draft = nnx.clone(target)  # new variables over the same arrays
    draft.config = target.config.replace(name=f"{target.config.name}[:{num_layers}]",
                                         num_layers=num_layers)
    draft.layers = nnx.List(list(draft.layers)[:num_layers])
    return draft


def draft_config(target_config: LlamaConfig, num_layers: int = 2) -> LlamaConfig:
    """A small draft of the target's width (shares its vocabulary, embedding and head)."""
    return target_config.replace(name=f"{target_config.name}-draft{num_layers}",
                                 num_layers=num_layers)


DRAFT_CONFIG = draft_config


def draft_own_params(draft: Llama) -> dict[str, object]:
    """The draft's own parameters by name: everything but the embedding and LM head."""
    return named_params(draft, skip=_is_shared)


def save_draft(draft: Llama, path: str | os.PathLike[str]) -> int:
    """Saves the draft's layers and final norm (bfloat16 safetensors); returns the file size."""
    meta = {"format": DRAFT_FORMAT, "config": config_metadata(draft.config),
            "num_layers": str(draft.config.num_layers)}
    return save_tensors(draft_own_params(draft), path, meta)


def load_draft(target: Llama, path: str | os.PathLike[str],
               dtype: jnp.dtype | None = None) -> Llama:
    """The draft saved at `path`, its embedding and head the target's own arrays; its layers in
    `dtype` (default: the target's weight dtype)."""
    tensors, metadata = read_tensors(path)
    check_format(metadata, DRAFT_FORMAT, os.fspath(path))
    saved = json.loads(metadata["config"])
    for field in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                  "vocab_size"):
        if saved[field] != getattr(target.config, field):
            raise ValueError(f"draft {os.fspath(path)!r} has {field}={saved[field]}, the target "
                             f"{getattr(target.config, field)}")
    config = draft_config(target.config, int(metadata["num_layers"]))
    draft = _shell(config, _weight_dtype(target) if dtype is None else dtype)
    missing = sorted(set(draft_own_params(draft)) - set(tensors))
    if missing:
        raise ValueError(f"{os.fspath(path)!r} lacks tensors {missing[:5]}")
    assign_params(draft, tensors, _weight_dtype(target) if dtype is None else dtype)
    shared = {k: v for k, v in named_params(target).items() if _is_shared(k)}
    assign_params(draft, shared)  # the same arrays, not copies
    return draft
