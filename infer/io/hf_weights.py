"""HF-layout tensors -> a `Llama` module: the one place that knows both naming schemes."""

from __future__ import annotations

from typing import Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from infer.model.config import LlamaConfig
from infer.model.llama import Llama


def _take(tensors: Mapping[str, np.ndarray], name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in tensors:
        raise ValueError(f"checkpoint has no tensor {name!r}")
    array = tensors[name]
    if array.shape != shape:
        raise ValueError(f"tensor {name!r} has shape {array.shape}, the config implies {shape}")
    return array


def model_from_hf_tensors(config: LlamaConfig, tensors: Mapping[str, np.ndarray],
                          dtype: jnp.dtype = jnp.float32) -> Llama:
    """Builds the model from tensors named and laid out as in HF's `LlamaForCausalLM`
    (linear weights `[out, in]`), cast to `dtype`, its weights on the host (numpy): where they go
    is placement's business (`infer.parallel.placement.place_model`), so that a sharded model is
    never whole on one device."""
    e, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    h, k, d = config.num_heads, config.num_kv_heads, config.head_dim
    model = nnx.eval_shape(lambda: Llama(config, dtype))  # shapes only: no throwaway init

    def put(param: nnx.Param, value: np.ndarray) -> None:
        param.set_value(np.ascontiguousarray(np.asarray(value).astype(jnp.dtype(dtype))))

    put(model.embed, _take(tensors, "model.embed_tokens.weight", (v, e)))
    put(model.norm.weight, _take(tensors, "model.norm.weight", (e,)))
    if model.lm_head is not None:
        put(model.lm_head, _take(tensors, "lm_head.weight", (v, e)))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        put(layer.input_norm.weight, _take(tensors, p + "input_layernorm.weight", (e,)))
        put(layer.post_attn_norm.weight, _take(tensors, p + "post_attention_layernorm.weight", (e,)))
        attn, mlp = layer.attn, layer.mlp
        put(attn.q_proj, _take(tensors, p + "self_attn.q_proj.weight", (h * d, e)).T)
        put(attn.k_proj, _take(tensors, p + "self_attn.k_proj.weight", (k * d, e)).T)
        put(attn.v_proj, _take(tensors, p + "self_attn.v_proj.weight", (k * d, e)).T)
        put(attn.o_proj, _take(tensors, p + "self_attn.o_proj.weight", (e, h * d)).T)
        put(mlp.gate_proj, _take(tensors, p + "mlp.gate_proj.weight", (f, e)).T)
        put(mlp.up_proj, _take(tensors, p + "mlp.up_proj.weight", (f, e)).T)
        put(mlp.down_proj, _take(tensors, p + "mlp.down_proj.weight", (e, f)).T)
    return model
