"""HF-layout tensors -> a `Llama` module: the one place that knows both naming schemes."""

from __future__ import annotations

import functools
from typing import Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from infer.io.checkpoint import check_tied_head
from infer.model.config import LlamaConfig
from infer.model.llama import Llama


def _take(tensors: Mapping[str, np.ndarray], name: str, shape: tuple[int, ...],
          taken: set[str]) -> np.ndarray:
    taken.add(name)
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
    check_tied_head(tensors, config.tie_word_embeddings, "checkpoint")
    model = nnx.eval_shape(lambda: Llama(config, dtype))  # shapes only: no throwaway init
    taken: set[str] = set()
    take = functools.partial(_take, tensors, taken=taken)

    def put(param: nnx.Param, value: np.ndarray) -> None:
        param.set_value(np.ascontiguousarray(np.asarray(value).astype(jnp.dtype(dtype))))

    put(model.embed, take("model.embed_tokens.weight", (v, e)))
    put(model.norm.weight, take("model.norm.weight", (e,)))
    if model.lm_head is not None:
        put(model.lm_head, take("lm_head.weight", (v, e)))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        put(layer.input_norm.weight, take(p + "input_layernorm.weight", (e,)))
        put(layer.post_attn_norm.weight, take(p + "post_attention_layernorm.weight", (e,)))
        attn, mlp = layer.attn, layer.mlp
        put(attn.q_proj, take(p + "self_attn.q_proj.weight", (h * d, e)).T)
        put(attn.k_proj, take(p + "self_attn.k_proj.weight", (k * d, e)).T)
        put(attn.v_proj, take(p + "self_attn.v_proj.weight", (k * d, e)).T)
        put(attn.o_proj, take(p + "self_attn.o_proj.weight", (e, h * d)).T)
        put(mlp.gate_proj, take(p + "mlp.gate_proj.weight", (f, e)).T)
        put(mlp.up_proj, take(p + "mlp.up_proj.weight", (f, e)).T)
        put(mlp.down_proj, take(p + "mlp.down_proj.weight", (e, f)).T)
    # What read_hf_dir drops too: inverse frequencies follow from the config, and a tied
    # model's head is its embedding.
    unused = sorted(n for n in set(tensors) - taken if not n.endswith("rotary_emb.inv_freq")
                    and not (n == "lm_head.weight" and config.tie_word_embeddings))
    if unused:
        # A bias or any other tensor this model has no place for would be silently dropped,
        # giving a model that runs but is wrong.
        raise ValueError(f"unexpected tensor {unused[0]!r} for a Llama model "
                         f"({len(unused)} unexpected in all)")
    return model
