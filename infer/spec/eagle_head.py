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

EAGLE-3 (`feature_layers` non-empty): the target hands over more than its final hidden state,
the residual stream after a low and a middle decoder layer as well (`Llama.__call__`'s
`feature_layers`), and `features_in` fuses them into the head's E-wide input,

    fuse(concat(norm_1(x_low), norm_2(x_mid), h_final))   [3E -> E]

in place of h_t. Drafts past the first still feed the head's own output ĥ in that place: the
training-time test (`experiments.train_eagle`'s drafted-step passes) teaches the head to read
it there. `fuse` starts at [0 | 0 | I], so a fresh EAGLE-3 head given an EAGLE-1 head's other
weights (`from_eagle1`) drafts exactly as that head did, and training starts from there.

Weights are stored as named tensors in safetensors (bfloat16 on disk, float32 by default in
memory): `save_eagle` / `load_eagle`. `named_params` / `assign_params` are the generic helpers,
shared with `infer.spec.draft_model`.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
from flax import nnx

from infer.cache.contiguous import KVCache
from infer.cache.metadata import AttentionMetadata
from infer.io.tensors import (assign_params, check_format, config_metadata, named_params,
                              read_tensors, save_tensors)
from infer.model.config import LlamaConfig
from infer.model.llama import (CacheT, DecoderLayer, Llama, RMSNorm, check_feature_layers, dense,
                               param, rope_frequencies)
from infer.model.sharding import EMBED

EAGLE_FORMAT = "infer-eagle-head-v1"


class EagleHead(nnx.Module):
    """fc [2E -> E] + one `DecoderLayer` + final `RMSNorm`, over the target's features; with
    `feature_layers`, a fuse [(n + 1) E -> E] over the target's layers first (EAGLE-3)."""

    def __init__(self, config: LlamaConfig, dtype: jnp.dtype = jnp.float32,
                 rngs: nnx.Rngs | None = None, feature_layers: tuple[int, ...] = ()):
        check_feature_layers(feature_layers, config.num_layers)
        self.config = config
        self.feature_layers = tuple(int(i) for i in feature_layers)
        e, n = config.hidden_size, len(self.feature_layers)
        self.fc = param((2 * e, e), (None, EMBED), dtype, rngs, 2 * e)
        self.layer = DecoderLayer(config, dtype, rngs)
        self.norm = RMSNorm(e, config.rms_norm_eps, dtype)
        if n:
            # The raw residual stream's scale grows with depth: each tap is normalized first.
            self.tap_norms = nnx.List([RMSNorm(e, config.rms_norm_eps, dtype) for _ in range(n)])
            passthrough = jnp.concatenate([jnp.zeros((n * e, e)), jnp.eye(e)]).astype(dtype)
            self.fuse = nnx.Param(passthrough, logical_axes=(None, EMBED))

    @property
    def feature_size(self) -> int:
        """Width of the target features the head reads: (len(feature_layers) + 1) * E."""
        return (len(self.feature_layers) + 1) * self.config.hidden_size

    def features_in(self, features: jax.Array) -> jax.Array:
        """The target's features [..., feature_size] as the head's input [..., E]: the final
        hidden state itself (EAGLE-1), or the fused taps (EAGLE-3). The head's own predictions
        ĥ are already in that space and skip this."""
        features = features.astype(jnp.float32)
        if not self.feature_layers:
            return features
        e = self.config.hidden_size
        taps = [norm(features[..., i * e:(i + 1) * e]) for i, norm in enumerate(self.tap_norms)]
        fused = jnp.concatenate(taps + [features[..., -e:]], axis=-1)
        return dense(fused, self.fuse[...], "...f,fe->...e")

    def create_cache(self, batch: int, max_len: int, dtype: jnp.dtype = jnp.float32) -> KVCache:
        """The head's own contiguous KV cache: one layer."""
        return KVCache.create(1, batch, max_len, self.config.num_kv_heads, self.config.head_dim,
                              dtype)

    def __call__(self, features: jax.Array, next_tokens: jax.Array,
                 embed: jax.Array | nnx.Variable, cache: CacheT, meta: AttentionMetadata
                 ) -> tuple[jax.Array, CacheT]:
        """features [B, T, E] (h_t through `features_in`, or the head's own ĥ_t), next_tokens
        [B, T] (x_{t+1}), embed [V, E] (the target's) -> (predicted features [B, T, E]
        (ĥ_{t+1}, normalized), cache)."""
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

    features [B, T, F]: the target's features (`head.feature_size` wide, the final hidden states
    h_t last); tokens [B, T]; lengths [B] (valid tokens per row, the rest padding); `noise`
    [B, T, E], optional, is added to the head's input (EAGLE's robustness to its own imprecise
    features at draft time).

    Returns (predicted [B, T-1, E]: row t is ĥ_{t+1} from (h_t, x_{t+1}); wanted [B, T-1, E]:
    h_{t+1}; mask [B, T-1] float: t + 1 < length; the head's cache, slots 0..T-2).
    """
    b, t, _ = features.shape
    final = features[..., -head.config.hidden_size:].astype(jnp.float32)
    inputs = head.features_in(features[:, :-1])
    inputs = inputs if noise is None else inputs + noise[:, :-1]
    valid = jnp.maximum(lengths.astype(jnp.int32) - 1, 1)  # rows t = 0 .. length-2
    meta = AttentionMetadata.for_prefill(valid, t - 1)
    predicted, cache = head(inputs, tokens[:, 1:], target.embed, head.create_cache(b, t - 1), meta)
    mask = (jnp.arange(t - 1)[None, :] < (lengths[:, None] - 1)).astype(jnp.float32)
    return predicted, jax.lax.stop_gradient(final[:, 1:]), mask, cache


# -- named tensors ---------------------------------------------------------------------------


def save_eagle(head: EagleHead, path: str | os.PathLike[str]) -> int:
    """Saves the head's weights (bfloat16 safetensors). Returns the file size in bytes."""
    return save_tensors(named_params(head), path,
                        {"format": EAGLE_FORMAT, "config": config_metadata(head.config),
                         "feature_layers": json.dumps(list(head.feature_layers))})


def from_eagle1(head: EagleHead, feature_layers: tuple[int, ...]) -> EagleHead:
    """An EAGLE-3 head over `feature_layers` with `head`'s fc, layer and norm and the
    pass-through fuse: it drafts as `head` does until trained."""
    if head.feature_layers:
        raise ValueError(f"from_eagle1 takes an EAGLE-1 head; this one reads layers "
                         f"{head.feature_layers}")
    widened = EagleHead(head.config, head.fc[...].dtype, nnx.Rngs(0), feature_layers)
    assign_params(widened, named_params(head), head.fc[...].dtype)
    return widened


def load_eagle(config: LlamaConfig, path: str | os.PathLike[str],
               dtype: jnp.dtype = jnp.float32) -> EagleHead:
    """The head saved at `path`, for a target of `config`, with weights in `dtype`; an EAGLE-3
    head reads its feature layers from the file."""
    tensors, metadata = read_tensors(path)
    check_format(metadata, EAGLE_FORMAT, os.fspath(path))
    layers = tuple(json.loads(metadata.get("feature_layers", "[]")))
    head = nnx.eval_shape(lambda: EagleHead(config, dtype, feature_layers=layers))
    missing = sorted(set(named_params(head)) - set(tensors))
    if missing:
        raise ValueError(f"{os.fspath(path)!r} lacks tensors {missing[:5]}")
    assign_params(head, tensors, dtype)
    return head
