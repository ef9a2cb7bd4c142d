"""EAGLE's draft head: one decoder layer that predicts the target's next feature vector.

The target's *feature* at position t is its final hidden state h_t (after the final RMSNorm, the
vector the LM head multiplies). The head reads, at each position t, the pair

    concat(h_t, embed[x_{t+1}])   [2E]  ->  fc  ->  DecoderLayer  ->  RMSNorm  ->  ĥ_{t+1}  [E]

(the feature at t and the embedding of the token that followed it) and predicts the feature at
t+1, normalized like the target's, so `target.logits(ĥ_{t+1})` is the draft's distribution of
x_{t+2}. The head shares the target's embedding and LM head and owns no vocabulary weights.

Drafting k tokens after the target has verified x_0..x_n (features h_0..h_{n-1} known, x_n just
sampled): feed (h_{n-1}, x_n) -> ĥ_n -> x̂_{n+1} = argmax logits(ĥ_n); then (ĥ_n, x̂_{n+1}) ->
ĥ_{n+1} -> x̂_{n+2}; and so on, the head's own predictions standing in for the features it has not
been given. Row t of the head's input sits at RoPE position t and cache slot t of the head's own
one-layer KV cache (layer index 0), so its cache advances in step with the target's.

Weights are stored as named tensors in safetensors (bfloat16 on disk, float32 by default in
memory): `save_eagle` / `load_eagle`. `named_params` / `assign_params` are the generic helpers,
shared with `infer.draft`.
"""

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

from infer.config import LlamaConfig
from infer.kv_cache import AttentionMetadata, KVCache
from infer.model import CacheT, DecoderLayer, Llama, RMSNorm, _param, dense, rope_frequencies
from infer.sharding import EMBED

EAGLE_FORMAT = "infer-eagle-head-v1"


class EagleHead(nnx.Module):
    """fc [2E -> E] + one `DecoderLayer` + final `RMSNorm`, over the target's features."""

    def __init__(self, config: LlamaConfig, dtype: jnp.dtype = jnp.float32,
                 rngs: nnx.Rngs | None = None):
        self.config = config
        e = config.hidden_size
        self.fc = _param((2 * e, e), (None, EMBED), dtype, rngs, 2 * e)
        self.layer = DecoderLayer(config, dtype, rngs)
        self.norm = RMSNorm(e, config.rms_norm_eps, dtype)

    def create_cache(self, batch: int, max_len: int, dtype: jnp.dtype = jnp.float32) -> KVCache:
        """The head's own contiguous KV cache: one layer."""
        return KVCache.create(1, batch, max_len, self.config.num_kv_heads, self.config.head_dim,
                              dtype)

    def __call__(self, features: jax.Array, next_tokens: jax.Array,
                 embed: jax.Array | nnx.Variable, cache: CacheT, meta: AttentionMetadata
                 ) -> tuple[jax.Array, CacheT]:
        """features [B, T, E] (h_t), next_tokens [B, T] (x_{t+1}), embed [V, E] (the target's)
        -> (predicted features [B, T, E] (ĥ_{t+1}, normalized), cache)."""
        table = embed[...] if isinstance(embed, nnx.Variable) else embed
        x = jnp.concatenate([features.astype(jnp.float32),
                             table[next_tokens].astype(jnp.float32)], axis=-1)
        x = dense(x, self.fc[...], "btf,fe->bte")
        inv_freq = jnp.asarray(rope_frequencies(self.config))  # a compile-time constant
        x, cache = self.layer(x, 0, cache, meta, inv_freq)
        return self.norm(x), cache


def eagle_logits(target: Llama, predicted: jax.Array) -> jax.Array:
    """The draft's next-token logits [..., V] from predicted features [..., E]: the target's head."""
    return target.logits(predicted)


def eagle_forward(head: EagleHead, target: Llama, features: jax.Array, tokens: jax.Array,
                  lengths: jax.Array, noise: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array, jax.Array, KVCache]:
    """Teacher-forced pass over whole sequences, one call with full causal attention.

    features [B, T, E]: the target's final hidden states h_t; tokens [B, T]; lengths [B] (valid
    tokens per row, the rest padding); `noise` [B, T, E], optional, is added to the input
    features (EAGLE's robustness to its own imprecise features at draft time).

    Returns (predicted [B, T-1, E]: row t is ĥ_{t+1} from (h_t, x_{t+1}); wanted [B, T-1, E]:
    h_{t+1}; mask [B, T-1] float: t + 1 < length; the head's cache, slots 0..T-2).
    """
    b, t, _ = features.shape
    features = features.astype(jnp.float32)
    inputs = features[:, :-1] if noise is None else features[:, :-1] + noise[:, :-1]
    valid = jnp.maximum(lengths.astype(jnp.int32) - 1, 1)  # rows t = 0 .. length-2
    meta = AttentionMetadata.for_prefill(valid, t - 1)
    predicted, cache = head(inputs, tokens[:, 1:], target.embed, head.create_cache(b, t - 1), meta)
    mask = (jnp.arange(t - 1)[None, :] < (lengths[:, None] - 1)).astype(jnp.float32)
    return predicted, jax.lax.stop_gradient(features[:, 1:]), mask, cache


def feature_loss(target: Llama, predicted: jax.Array, wanted: jax.Array, mask: jax.Array,
                 cls_weight: float | jax.Array = 0.1, target_logits: jax.Array | None = None
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """SmoothL1(ĥ, h) + cls_weight * CE(softmax(logits(h)), logits(ĥ)), averaged where mask.

    Also returns the parts and `top1` (the head's argmax equals the target's), each a mean over
    the masked positions, `count` (how many), `hit` [B, T] (per position, unmasked) and
    `target_logits` (logits(h), which a caller may pass back in to skip recomputing them)."""
    count = jnp.maximum(mask.sum(), 1.0)
    mean = lambda x: (x * mask).sum() / count
    diff = jnp.abs(predicted - wanted)
    smooth_l1 = jnp.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5).mean(-1)
    draft_logits = eagle_logits(target, predicted)
    if target_logits is None:
        target_logits = eagle_logits(target, wanted)
    target_logits = jax.lax.stop_gradient(target_logits)
    target_probs = jax.nn.softmax(target_logits, axis=-1)
    ce = -(target_probs * jax.nn.log_softmax(draft_logits, axis=-1)).sum(-1)
    hit = (jnp.argmax(draft_logits, -1) == jnp.argmax(target_logits, -1)).astype(jnp.float32)
    reg, cls = mean(smooth_l1), mean(ce)
    loss = reg + cls_weight * cls
    return loss, {"loss": loss, "reg": reg, "ce": cls, "top1": mean(hit), "count": mask.sum(),
                  "hit": hit, "target_logits": target_logits}


def eagle_loss(head: EagleHead, target: Llama, features: jax.Array, tokens: jax.Array,
               lengths: jax.Array, cls_weight: float | jax.Array = 0.1,
               noise: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """EAGLE's training loss over whole sequences (`eagle_forward`, then `feature_loss`):
    SmoothL1(ĥ_{t+1}, h_{t+1}) + cls_weight * CE(softmax(logits(h_{t+1})), logits(ĥ_{t+1})),
    averaged over positions t with t + 1 < length; the metrics as `feature_loss` gives them
    (`hit` [B, T-1] per position)."""
    predicted, wanted, mask, _ = eagle_forward(head, target, features, tokens, lengths, noise)
    return feature_loss(target, predicted, wanted, mask, cls_weight)


# -- named tensors ---------------------------------------------------------------------------

def _path_name(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def named_params(module: nnx.Module, skip: Callable[[str], bool] = lambda name: False
                 ) -> dict[str, jax.Array]:
    """{"layers.0.attn.q_proj": array, ...}: every nnx.Param of `module` by dotted path, except
    the names `skip` rejects. The arrays are the module's own (no copy)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(module, nnx.Param)):
        name = _path_name(path)
        if not skip(name):
            out[name] = var.get_value()
    return out


def assign_params(module: nnx.Module, tensors: Mapping[str, jax.Array | np.ndarray],
                  dtype: jnp.dtype | None = None, strict: bool = True) -> None:
    """Sets the module's parameters from named tensors (cast to `dtype` when given, otherwise
    assigned as they are: the same arrays). Shapes must match; with `strict`, every name must
    exist in the module and every tensor must be used. Raises ValueError naming the problem."""
    params = {_path_name(p): v for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}
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


def _check_format(metadata: Mapping[str, str], fmt: str, path: str) -> None:
    if metadata.get("format") != fmt:
        raise ValueError(f"{path!r} is not an {fmt} file (format={metadata.get('format')!r})")


def save_eagle(head: EagleHead, path: str | os.PathLike[str]) -> int:
    """Saves the head's weights (bfloat16 safetensors). Returns the file size in bytes."""
    return save_tensors(named_params(head), path,
                        {"format": EAGLE_FORMAT, "config": config_metadata(head.config)})


def load_eagle(config: LlamaConfig, path: str | os.PathLike[str],
               dtype: jnp.dtype = jnp.float32) -> EagleHead:
    """The head saved at `path`, for a target of `config`, with weights in `dtype`."""
    tensors, metadata = read_tensors(path)
    _check_format(metadata, EAGLE_FORMAT, os.fspath(path))
    head = nnx.eval_shape(lambda: EagleHead(config, dtype))
    missing = sorted(set(named_params(head)) - set(tensors))
    if missing:
        raise ValueError(f"{os.fspath(path)!r} lacks tensors {missing[:5]}")
    assign_params(head, tensors, dtype)
    return head
