"""After every step of a speculative engine, its pages must hold what plain decoding writes: the
check both rollback (chains) and compaction (trees) are held to."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from infer.cache.contiguous import KVCache
from infer.cache.metadata import AttentionMetadata
from infer.engine.engine import Engine
from infer.model.llama import Llama


def run_checking_pages(engine: Engine, model: Llama) -> int:
    """Steps `engine` (float32 pages) until done. After every step, each running request holds
    exactly the pages its computed tokens need, and their keys and values equal one plain
    forward of `model` over those tokens. Returns how many (step, request) pairs were checked."""
    c, max_len, g = model.config, engine.config.max_model_len, engine.config.page_size

    @jax.jit
    def plain_kv(tokens: jax.Array, n: jax.Array) -> tuple[list[jax.Array], list[jax.Array]]:
        """Keys and values [K, max_len, D] per layer of one forward over the first n tokens
        (one shape for every n: an eager forward compiled anew at each length)."""
        cache = KVCache.create(c.num_layers, 1, max_len, c.num_kv_heads, c.head_dim)
        _, _, cache = model(tokens[None], cache, AttentionMetadata.for_prefill(n[None], max_len))
        return [k[0] for k in cache.k], [v[0] for v in cache.v]

    checked = 0
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            n = seq.num_computed
            assert len(seq.pages.pages) == math.ceil(n / g)
            if n == 0:
                continue
            tokens = np.zeros(max_len, np.int32)
            tokens[:n] = seq.request.all_token_ids[:n]
            keys, values = plain_kv(jnp.asarray(tokens), jnp.asarray(n, jnp.int32))
            slots = np.array([seq.pages.slot(t) for t in range(n)])
            cache = engine.runner.cache
            for layer in range(c.num_layers):
                for pools, plain in ((cache.k, keys), (cache.v, values)):
                    pool = np.asarray(pools[layer])  # [P, K, G, D]
                    paged = pool.swapaxes(1, 2).reshape(-1, *pool.shape[1::2])[slots]  # [n, K, D]
                    want = np.asarray(plain[layer])[:, :n].transpose(1, 0, 2)  # -> [n, K, D]
                    np.testing.assert_allclose(paged, want, atol=1e-5)
            checked += 1
    return checked
