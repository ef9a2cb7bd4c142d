"""`load(name_or_path)`: a preset with bundled weights, a GGUF file or a HF directory."""

from __future__ import annotations

import os
from typing import Callable

import jax.numpy as jnp

from infer.io.checkpoint import read_checkpoint, smollm2_gguf_path
from infer.io.hf_weights import model_from_hf_tensors
from infer.io.tokenizer import Tokenizer, hf_tokenizer_file
from infer.model.config import PRESETS, LlamaConfig
from infer.model.llama import Llama
from infer.parallel.placement import place_model

# Presets whose weights ship with an installed package; the rest are shapes only.
BUNDLED = {"smollm2-135m": smollm2_gguf_path}

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def resolve_dtype(dtype: str | jnp.dtype) -> jnp.dtype:
    """The weight dtype for a name in DTYPES or a dtype object of one; ValueError otherwise."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported weight dtype {dtype!r}; choose one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        resolved = None
    # Objects too: jnp.int8 or np.float64 would otherwise load, and fail (or silently run in
    # a dtype the model was never checked in) much later.
    if resolved is None or resolved.name not in DTYPES:
        raise ValueError(f"unsupported weight dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return resolved


def resolve_path(name_or_path: str | os.PathLike[str]) -> tuple[str, str]:
    """(checkpoint path, model name) for a bundled preset or an existing path."""
    name = os.fspath(name_or_path)
    if name in BUNDLED:
        return BUNDLED[name](), name
    if os.path.exists(name):
        return name, os.path.basename(os.path.normpath(name))
    if name in PRESETS:
        raise ValueError(f"preset {name!r} has no bundled weights (only {sorted(BUNDLED)} do); "
                         "pass the path of a GGUF file or a HF directory holding its weights")
    if os.sep in name or name.endswith((".gguf", ".safetensors")):
        raise FileNotFoundError(f"model path {name!r} does not exist")
    raise ValueError(f"unknown model {name!r}: neither a bundled preset {sorted(BUNDLED)} nor an "
                     "existing GGUF file or HF directory")


def load(name_or_path: str | os.PathLike[str], dtype: str | jnp.dtype = "float32"
         ) -> tuple[LlamaConfig, Llama, Tokenizer]:
    """Loads (config, model, tokenizer), the weights on the default device. The model is the
    Flax module holding the weights; `infer.model.binding.binding(model)` gives the flat weights
    the jitted steps take."""
    config, model, tokenizer = load_on_host(name_or_path, dtype)
    return config, place_model(model, None), tokenizer


def load_on_host(name_or_path: str | os.PathLike[str], dtype: str | jnp.dtype = "float32",
                 check_config: Callable[[LlamaConfig], None] | None = None
                 ) -> tuple[LlamaConfig, Llama, Tokenizer]:
    """`load` with the weights left in host memory (numpy), for placement on a mesh
    (`infer.parallel.placement.place_model`). `check_config` sees the model's config before
    its weights are read: settings the model's shapes rule out fail first."""
    weight_dtype = resolve_dtype(dtype)  # before the read: a GGUF takes seconds to dequantize
    path, name = resolve_path(name_or_path)

    def check(hf_config: dict) -> None:
        # Before the tensors are read: an unsupported config (a rope type, a bias), settings
        # it rules out, then a directory with no tokenizer.
        config = LlamaConfig.from_hf_dict(hf_config, name=name)
        if check_config is not None:
            check_config(config)
        if os.path.isdir(path):
            hf_tokenizer_file(path)

    checkpoint = read_checkpoint(path, check)
    # Parsed again: a GGUF's rope_freqs tensor, read after the check, sets its RoPE scaling.
    config = LlamaConfig.from_hf_dict(checkpoint.hf_config, name=name)
    model = model_from_hf_tensors(config, checkpoint.tensors, weight_dtype)
    return config, model, Tokenizer.from_checkpoint(checkpoint)
