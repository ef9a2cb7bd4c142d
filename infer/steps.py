"""The jitted device steps: prefill (compute-bound) and decode (memory-bound), kept separate.

Both take the model as (graphdef, params) -- the graphdef static, the params a pytree -- and the
KV cache donated, so XLA updates it in place. Everything that changes from call to call
(tokens, lengths, page tables, sampling parameters) is an array; only shapes are static.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from infer.kv_cache import AttentionMetadata
from infer.model import CacheT, Llama
from infer.sampling import SamplingArrays, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """What one decode step needs from the previous one, kept on device between steps."""

    tokens: jax.Array  # [B] int32, the last sampled token of each row (the next input)
    lengths: jax.Array  # [B] int32, tokens in the cache
    steps: jax.Array  # [B] int32, tokens sampled so far (for the per-row PRNG stream)
    sampling: SamplingArrays
    page_tables: jax.Array | None = None  # [B, n] int32 for a paged cache


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def prefill_step(graphdef: nnx.GraphDef[Llama], params: nnx.State, cache: CacheT,
                 tokens: jax.Array, meta: AttentionMetadata, sampling: SamplingArrays,
                 steps: jax.Array) -> tuple[jax.Array, jax.Array, CacheT]:
    """Runs rows of new tokens [B, T] (padded past meta.q_lens) through the model, writing their
    KV, and samples one token after each row's last valid token.

    Returns (next tokens [B], logits at the last valid token [B, V], cache).
    """
    model = nnx.merge(graphdef, params)
    last = jnp.maximum(meta.q_lens - 1, 0)[:, None]
    logits, _, cache = model(tokens, cache, meta, logit_index=last)
    logits = logits[:, 0]
    return sample(logits, sampling, steps), logits, cache


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def decode_step(graphdef: nnx.GraphDef[Llama], params: nnx.State, cache: CacheT,
                state: DecodeState) -> tuple[DecodeState, jax.Array, CacheT]:
    """Feeds each row's last token, writes its KV, samples the next. Returns (state, logits, cache)."""
    model = nnx.merge(graphdef, params)
    meta = AttentionMetadata.for_decode(state.lengths, state.page_tables)
    logits, _, cache = model(state.tokens[:, None], cache, meta)
    logits = logits[:, 0]
    tokens = sample(logits, state.sampling, state.steps)
    state = dataclasses.replace(state, tokens=tokens, lengths=state.lengths + 1,
                                steps=state.steps + 1)
    return state, logits, cache
