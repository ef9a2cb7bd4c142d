"""Llama in Flax NNX: RMSNorm, RoPE (with Llama-3.1 scaling), grouped-query attention, SwiGLU.

The model holds weights only. The KV cache is passed in and returned; where new keys and values
go and which slots each query reads is the cache's business (`infer.cache.protocol`).

Activations and the residual stream stay in float32; weights may be bfloat16, in which case each
matmul multiplies bfloat16 inputs with float32 accumulation (`preferred_element_type`), which
XLA:CPU runs several times faster than a bfloat16-accumulating product.

Layers are a Python list of modules, unrolled under jit: XLA:CPU copies each layer's slice out of
stacked `[L, ...]` weights inside a `scan`, which halved decode bandwidth when measured.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from infer.cache.metadata import AttentionMetadata
from infer.cache.protocol import CacheT
from infer.model.config import LlamaConfig
from infer.model.sharding import (BATCH, EMBED, FFN, HEAD_DIM, HEADS, KV_HEADS, SEQ, VOCAB,
                                  replicate, shard)
from kernels_cpu import dense as dense_cpu


def param(shape: tuple[int, ...], axes: tuple[str, ...], dtype: jnp.dtype, rngs: nnx.Rngs | None,
           fan_in: int | None = None) -> nnx.Param:
    """Random normal weights (std 1/sqrt(fan_in)) or ones when fan_in is None (norm scales).
    Without rngs the array is zeros, for models whose weights a loader will overwrite."""
    if fan_in is None:
        value = jnp.ones(shape, dtype)
    elif rngs is None:
        value = jnp.zeros(shape, dtype)
    else:
        value = (jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)
    return nnx.Param(value, logical_axes=axes)


def dense(x: jax.Array, w: jax.Array, equation: str) -> jax.Array:
    """einsum of activations with a weight, accumulating in float32 whatever the weight dtype.

    On CPU, products of a few rows (decode and verify steps) are bound by reading the weight,
    which XLA:CPU does slowly outside a one-row float32 GEMV, and batched steps by multiplies
    its GEMMs do slower than a register-tiled kernel; the products `kernels_cpu.dense` runs
    faster (its ROWS table, measured per kind of CPU: where XLA multiplies bfloat16 on AMX
    tiles, its GEMMs keep the batched bfloat16 products) go to that kernel, unless a mesh is
    active. The rest is `xla_dense`. A weight `tile_weights` stored in the kernel's tile layout
    goes to the kernel at every row count (to `xla_dense`, unpacked, under a mesh).
    Accelerators are not affected."""
    layout = _kernel_layout(x, w, equation)
    if layout is None:
        return xla_dense(x, w, equation)
    (out,) = _kernel_products(x, (w,), layout)
    return out


def dense_group(x: jax.Array, weights: tuple[jax.Array, ...], equation: str
                ) -> tuple[jax.Array, ...]:
    """`dense` of the same activations with several weights of one dtype (a layer's query, key
    and value projections; its gate and up projections). Where `dense` would hand each of them
    to the CPU kernel, they go to it in one call (`kernels_cpu.dense.multiply_group`), which
    splits them between the threads as one piece of work: one hand-off to the pool instead of
    three, and SmolLM2's key and value weights, too small to be split on their own, share both
    threads (README, "Grouped products"). The values are `dense`'s, bit for bit."""
    layouts = {_kernel_layout(x, w, equation) for w in weights}
    if (len(layouts) == 1 and None not in layouts and len({w.dtype for w in weights}) == 1
            and len({dense_cpu.is_packed(w) for w in weights}) == 1):
        return _kernel_products(x, weights, layouts.pop())
    return tuple(dense(x, w, equation) for w in weights)


def _kernel_layout(x: jax.Array, w: jax.Array, equation: str) -> str | None:
    """The layout ("kn" or "nk") under which `kernels_cpu.dense` should run x times w, or None
    when XLA should: another contraction, a mesh active, or a product outside its ROWS."""
    layout = _weight_layout(equation)
    if (layout is not None and jax.sharding.get_abstract_mesh().empty
            and dense_cpu.takes(math.prod(x.shape[:-1]), w, layout)):
        return layout
    return None


def _kernel_products(x: jax.Array, weights: tuple[jax.Array, ...], layout: str
                     ) -> tuple[jax.Array, ...]:
    """x [..., K] times each weight by the CPU kernel, in one call -> [..., N_i] each."""
    rows = x.astype(weights[0].dtype).reshape(-1, x.shape[-1])
    outs = dense_cpu.multiply_group(rows, weights, layout)
    return tuple(out.reshape(*x.shape[:-1], out.shape[-1]) for out in outs)


def xla_dense(x: jax.Array, w: jax.Array, equation: str) -> jax.Array:
    """`dense` by XLA alone, as it runs without the CPU kernel (no AVX-512 or no compiler) or
    past its ROWS. On CPU a one-row product with 16-bit weights is padded to two rows: XLA:CPU
    sends a one-row bfloat16 dot down a path that first converts the whole weight to float32
    (the [1, 576] x [576, 49152] vocabulary projection of SmolLM2 took 31 ms, against 2.9 ms for
    two rows); and a float32 product of a few rows with a [N, K] weight (a verify step's k + 1
    positions through the vocabulary projection) is a multiply-and-reduce
    (`_reduces_few_rows`). A packed weight (`tile_weights`) is unpacked first."""
    if dense_cpu.is_packed(w):
        w = dense_cpu.unpack(w)
    x = x.astype(w.dtype)
    if _reduces_few_rows(x, w, equation):
        return _few_rows_product(x, w)
    if not _pads_single_rows(x, w):
        return jnp.einsum(equation, x, w, preferred_element_type=jnp.float32)
    rows = x[None] if x.ndim == 1 else x  # a vector (only "..." equations take one): one row
    padded = jnp.concatenate([rows, jnp.zeros_like(rows)], axis=0)
    out = jnp.einsum(equation, padded, w, preferred_element_type=jnp.float32)[:1]
    return out[0] if x.ndim == 1 else out


def _weight_layout(equation: str) -> str | None:
    """"kn" for a weight stored [in, out] ("bte,ef->btf"), "nk" for one stored [out, in]
    ("...e,ve->...v"), None for any other contraction."""
    inputs, out = equation.replace(" ", "").split("->")
    lhs, rhs = inputs.split(",")
    if len(rhs) != 2:
        return None
    if rhs[0] == lhs[-1] and out == lhs[:-1] + rhs[1]:
        return "kn"
    if rhs[1] == lhs[-1] and out == lhs[:-1] + rhs[0]:
        return "nk"
    return None


def _pads_single_rows(x: jax.Array, w: jax.Array) -> bool:
    return (math.prod(x.shape[:-1]) == 1 and w.dtype.itemsize < 4
            and jax.default_backend() == "cpu")


# Rows up to which a float32 product against a [N, K] weight is a multiply-and-reduce on CPU.
FEW_ROWS = 8


def _reduces_few_rows(x: jax.Array, w: jax.Array, equation: str) -> bool:
    """A float32 product of 2..FEW_ROWS rows with a weight stored [N, K] (the vocabulary
    projection: "...e,ve->...v") on CPU. XLA:CPU multiplies one row by a GEMV that reads the
    weight once (SmolLM2's [1, 576] x [49152, 576]^T: 2.9 ms) but 2-8 rows by a GEMM that costs
    twice that (5.4-6.0 ms, whichever operand goes first), which made a verify step of k + 1
    positions pay a second projection; the same product as an elementwise multiply summed over
    K, into [N, M], reads the weight once: 3.4-3.6 ms for 2-4 rows, 4.1-4.5 ms for 5-8. One
    row stays a GEMV (the reduction took 340 ms there), 16-bit weights a GEMM (2.4-2.6 ms for
    2-5 bfloat16 rows already), and weights stored [K, N] a GEMM (their products barely change
    from 1 to 5 rows)."""
    return (jax.default_backend() == "cpu" and w.dtype == jnp.float32 and w.ndim == 2
            and 2 <= math.prod(x.shape[:-1]) <= FEW_ROWS and _weight_layout(equation) == "nk")


def _few_rows_product(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] times w [N, K] over K -> [..., N] in float32, as one multiply-and-reduce."""
    rows = x.reshape(-1, x.shape[-1])
    # A barrier per product keeps its broadcast of w its own: XLA otherwise merges the equal
    # broadcasts of two same-shape products in one program (an unrolled draft loop, a tree's
    # levels) into one [N, M, K] array that no fusion can absorb, and materializes it: two
    # 2-row SmolLM2 projections took 127 ms that way, against 12.8 ms with the barrier.
    w, rows = jax.lax.optimization_barrier((w, rows))
    out = jnp.sum(w[:, None, :] * rows[None, :, :], axis=-1)  # [N, M]: the layout measured
    return out.T.reshape(*x.shape[:-1], w.shape[0])


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = param((dim,), (EMBED,), dtype, None)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return x * self.weight[...].astype(jnp.float32)


def rope_frequencies(config: LlamaConfig) -> np.ndarray:
    """Inverse frequencies [D/2] as float32, Llama-3.1 scaled when the config says so."""
    d = config.head_dim
    inv_freq = (1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32)
                                               / np.float32(d)))).astype(np.float32)
    s = config.rope_scaling
    if s is None:
        return inv_freq
    # Wavelengths longer than the original context are stretched by `factor`, short ones kept,
    # and the band between them interpolated smoothly.
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    interpolated = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, interpolated, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE on x [B, T, N, D] at positions [B, T], computed in float32."""
    freqs = positions.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


class Attention(nnx.Module):
    """Projections are stored 2D ([E, H*D], [H*D, E]): with a separate head axis XLA:CPU chose to
    transpose and copy the output projection's weight every step rather than the activation."""

    def __init__(self, config: LlamaConfig, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        e, h, k, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, k, d
        self.q_proj = param((e, h * d), (EMBED, HEADS), dtype, rngs, e)
        self.k_proj = param((e, k * d), (EMBED, KV_HEADS), dtype, rngs, e)
        self.v_proj = param((e, k * d), (EMBED, KV_HEADS), dtype, rngs, e)
        self.o_proj = param((h * d, e), (HEADS, EMBED), dtype, rngs, h * d)

    def projections(self) -> tuple[nnx.Param, ...]:
        """The weights stored [in, out]."""
        return self.q_proj, self.k_proj, self.v_proj, self.o_proj

    def __call__(self, x: jax.Array, layer: int, cache: CacheT, meta: AttentionMetadata,
                 inv_freq: jax.Array) -> tuple[jax.Array, CacheT]:
        b, t, _ = x.shape
        heads = lambda y, n: y.reshape(b, t, n, self.head_dim)
        q, k, v = dense_group(x, (self.q_proj[...], self.k_proj[...], self.v_proj[...]),
                              "bte,ef->btf")
        q, k, v = heads(q, self.num_heads), heads(k, self.num_kv_heads), heads(v, self.num_kv_heads)
        q = shard(apply_rope(q, meta.positions, inv_freq), (BATCH, SEQ, HEADS, HEAD_DIM))
        k = apply_rope(k, meta.positions, inv_freq)
        cache, out = cache.write_and_attend(layer, q, k, v, meta)
        out = out.reshape(b, t, self.num_heads * self.head_dim)
        return dense(out, self.o_proj[...], "btf,fe->bte"), cache


class MLP(nnx.Module):
    def __init__(self, config: LlamaConfig, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        e, f = config.hidden_size, config.intermediate_size
        self.gate_proj = param((e, f), (EMBED, FFN), dtype, rngs, e)
        self.up_proj = param((e, f), (EMBED, FFN), dtype, rngs, e)
        self.down_proj = param((f, e), (FFN, EMBED), dtype, rngs, f)

    def projections(self) -> tuple[nnx.Param, ...]:
        """The weights stored [in, out]."""
        return self.gate_proj, self.up_proj, self.down_proj

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = dense_group(x, (self.gate_proj[...], self.up_proj[...]), "bte,ef->btf")
        hidden = shard(jax.nn.silu(gate) * up, (BATCH, SEQ, FFN))
        return dense(hidden, self.down_proj[...], "btf,fe->bte")


class DecoderLayer(nnx.Module):
    def __init__(self, config: LlamaConfig, dtype: jnp.dtype, rngs: nnx.Rngs | None):
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.attn = Attention(config, dtype, rngs)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype, rngs)

    def __call__(self, x: jax.Array, layer: int, cache: CacheT, meta: AttentionMetadata,
                 inv_freq: jax.Array) -> tuple[jax.Array, CacheT]:
        attn_out, cache = self.attn(self.input_norm(x), layer, cache, meta, inv_freq)
        x = x + attn_out
        x = x + self.mlp(self.post_attn_norm(x))
        return shard(x, (BATCH, SEQ, EMBED)), cache


class Llama(nnx.Module):
    """forward(tokens [B, T], cache, meta) -> (logits, hidden [B, T, E], cache).

    `logit_index` [B, N] picks the positions whose logits are computed (prefill needs only the
    last one; the vocabulary projection of every prompt token would dominate a short prefill).

    `feature_layers` (static) widens `hidden` into features for a draft head that reads several
    depths of the target (EAGLE-3): the residual stream after each of those decoder layers, in
    order, then the final hidden state, [B, T, (len(feature_layers) + 1) * E]. The last E
    columns are always the final hidden state, what the LM head multiplies.
    """

    def __init__(self, config: LlamaConfig, dtype: jnp.dtype = jnp.float32,
                 rngs: nnx.Rngs | None = None):
        self.config = config
        e, v = config.hidden_size, config.vocab_size
        self.embed = param((v, e), (VOCAB, EMBED), dtype, rngs, 1)
        self.layers = nnx.List([DecoderLayer(config, dtype, rngs) for _ in range(config.num_layers)])
        self.norm = RMSNorm(e, config.rms_norm_eps, dtype)
        # Stored [V, E] like the embedding: XLA:CPU multiplies small batches against it faster
        # than against [E, V].
        self.lm_head = None if config.tie_word_embeddings else param((v, e), (VOCAB, EMBED), dtype,
                                                                      rngs, e)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        return self.embed[...][tokens].astype(jnp.float32)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final hidden states [..., E] (after the final norm) -> logits [..., V] in float32.
        Under tensor parallelism each device computes its slice of the vocabulary, then one
        all-gather makes the logits whole everywhere: sampling (sorts, cumulative sums, argmax)
        then runs on every device alike with no collective of its own."""
        head = self.embed if self.lm_head is None else self.lm_head
        local = dense(hidden, head[...], "...e,ve->...v")
        # Pinned vocabulary-sharded first: left free, XLA gathered the whole [V, E] table instead.
        local = shard(local, (None,) * (local.ndim - 1) + (VOCAB,))
        return replicate(local)

    def __call__(self, tokens: jax.Array, cache: CacheT, meta: AttentionMetadata,
                 logit_index: jax.Array | None = None, feature_layers: tuple[int, ...] = ()
                 ) -> tuple[jax.Array, jax.Array, CacheT]:
        check_feature_layers(feature_layers, self.config.num_layers)
        x = shard(self.embed_tokens(tokens), (BATCH, SEQ, EMBED))
        inv_freq = jnp.asarray(rope_frequencies(self.config))  # a compile-time constant
        taps = []
        for i, layer in enumerate(self.layers):
            x, cache = layer(x, i, cache, meta, inv_freq)
            if i in feature_layers:
                taps.append(x)
        hidden = self.norm(x)
        picked = hidden if logit_index is None else jnp.take_along_axis(
            hidden, logit_index[:, :, None], axis=1)
        features = jnp.concatenate(taps + [hidden], axis=-1) if taps else hidden
        return self.logits(picked), features, cache


def tile_weights(model: Llama) -> Llama:
    """The model with each decoder layer's [in, out] projections that `kernels_cpu.dense.packs`
    stored in the CPU kernel's layout (`kernels_cpu.dense.pack`): bfloat16 in the AMX tiles'
    layout, which the tiles read as stored at every row count with no packing per call (README,
    "Weights in the tiles' layout"); float32 as strips of 32 columns, which batched products
    read contiguously (README, "Float32 weights as strips"). The model itself is returned where
    nothing packs; else a copy whose other weights are the model's arrays. For one device: under
    a mesh `dense` unpacks them every call."""
    if not any(dense_cpu.packs(weight.get_value()) for weight in _projections(model)):
        return model
    tiled = nnx.clone(model)  # new variables over the same arrays
    for weight in _projections(tiled):
        if dense_cpu.packs(weight.get_value()):
            weight.set_value(dense_cpu.pack(weight.get_value()))
    return tiled


def is_tiled(model: Llama) -> bool:
    """Whether any of the model's projections is in the CPU kernel's layout (`tile_weights`)."""
    return any(dense_cpu.is_packed(weight.get_value()) for weight in _projections(model))


def _projections(model: Llama) -> list[nnx.Param]:
    """Every decoder layer's weights stored [in, out]."""
    return [weight for layer in model.layers
            for weight in (*layer.attn.projections(), *layer.mlp.projections())]


def check_feature_layers(feature_layers: tuple[int, ...], num_layers: int) -> None:
    """Feature layers are distinct decoder-layer indices in increasing order (the order in
    which `Llama.__call__` concatenates them, so a head's fuse weight reads them as trained)."""
    layers = tuple(feature_layers)
    if (any(not isinstance(i, (int, np.integer)) or not 0 <= i < num_layers for i in layers)
            or list(layers) != sorted(set(layers))):
        raise ValueError(f"feature_layers must be increasing distinct layer indices in "
                         f"[0, {num_layers}), got {layers}")
