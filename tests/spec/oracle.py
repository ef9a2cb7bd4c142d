"""A target and an EAGLE head that agrees with it: most drafts are accepted, so deep paths,
compaction and the head's catch-up all run (a random head's drafts are mostly rejected)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from infer.io.tensors import assign_params, named_params
from infer.model.config import LlamaConfig
from infer.model.llama import Llama
from infer.spec.eagle_head import EagleHead


def oracle_models(config: LlamaConfig) -> tuple[Llama, EagleHead]:
    """A one-layer target with damped attention, and a head that copies its layer: the head's
    ĥ(h, x) is close to the target's feature of x."""
    config = config.replace(num_layers=1)
    target = Llama(config, jnp.float32, nnx.Rngs(2))
    # Small embeddings: with the tied head, random layers otherwise leave each token's own
    # embedding dominant and greedy text repeats one token.
    target.embed.set_value(target.embed.get_value() * 0.05)
    o_proj = target.layers[0].attn.o_proj
    o_proj.set_value(o_proj.get_value() * 0.05)
    head = EagleHead(config, jnp.float32, nnx.Rngs(3))
    layer = {k[len("layers.0."):]: v for k, v in named_params(target).items()
             if k.startswith("layers.0.")}
    assign_params(head.layer, layer)
    assign_params(head.norm, {"weight": target.norm.weight.get_value()})
    e = config.hidden_size
    head.fc.set_value(jnp.concatenate([jnp.zeros((e, e)), jnp.eye(e)]))
    return target, head
