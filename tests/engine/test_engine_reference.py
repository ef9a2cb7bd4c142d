"""Randomized engine runs against a plain reference: the whole sequence recomputed from scratch
by the model over an unpaged cache at every token. Paging, chunking, page-table widths, padded
rows, mixed and asynchronous steps and the prefix cache must change no greedy token."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infer.cache.contiguous import KVCache
from infer.cache.metadata import AttentionMetadata
from infer.engine.engine import Engine, EngineConfig
from infer.model.binding import binding
from infer.sampling_params import SamplingParams

MAX_LEN = 64


def recompute_greedy(model) -> Callable[[list[int], int], tuple[list[int], list[float]]]:
    """greedy(prompt, max_tokens): greedy tokens and their logprobs, each from one forward over
    every token before it (no cache carried), compiled once."""
    bound, c = binding(model), model.config

    @jax.jit
    def last_logits(params, tokens, n):
        cache = KVCache.create(c.num_layers, 1, MAX_LEN, c.num_kv_heads, c.head_dim)
        meta = AttentionMetadata.for_prefill(n[None], MAX_LEN)
        logits, _, _ = bound.bind(params)(tokens, cache, meta, logit_index=(n - 1)[None, None])
        return jax.nn.log_softmax(logits[0, 0])

    def greedy(prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        ids, out, logprobs = list(prompt), [], []
        for _ in range(max_tokens):
            tokens = np.zeros((1, MAX_LEN), np.int32)
            tokens[0, :len(ids)] = ids
            row = np.asarray(last_logits(bound.params, tokens, np.int32(len(ids))))
            out.append(int(np.argmax(row)))
            logprobs.append(float(row[out[-1]]))
            ids.append(out[-1])
        return out, logprobs

    return greedy


@pytest.mark.parametrize("run", range(2))
def test_engine_greedy_equals_full_recompute(tiny_model, run: int) -> None:
    seed = int(np.random.SeedSequence().entropy % 2**32)  # a fresh setup each run, named below
    rng = np.random.default_rng(seed)
    page = int(rng.choice([1, 2, 4, 8, 16]))
    config = EngineConfig(
        page_size=page, max_num_seqs=int(rng.integers(1, 5)),
        max_prefill_tokens=int(rng.choice([8, 16, 24])), max_model_len=MAX_LEN,
        async_scheduling=bool(rng.integers(2)), mixed_steps=bool(rng.integers(2)),
        scheduler=str(rng.choice(["continuous", "static"])),
        enable_prefix_caching=bool(rng.integers(2)),
        min_window=int(rng.choice([4, 8, 16, 32])) if rng.integers(2) else None,
        num_pages=2 * MAX_LEN // page if rng.integers(2) else None)
    shared = rng.integers(1, tiny_model.config.vocab_size, MAX_LEN).tolist()
    requests = []
    for _ in range(int(rng.integers(2, 6))):
        n = int(rng.integers(1, MAX_LEN))
        prompt = (shared[:n] if rng.integers(2)
                  else rng.integers(1, tiny_model.config.vocab_size, n).tolist())
        # Some rows ask for logprobs: the chosen token's logprob checks the logits themselves,
        # which a small error (a position off by one) moves without changing the argmax.
        requests.append((prompt, int(rng.integers(1, MAX_LEN - n + 1)),
                         1 if rng.integers(2) else None))
    engine = Engine(tiny_model, None, config)
    ids = [engine.add_request(prompt_token_ids=p, params=SamplingParams(
        max_tokens=m, ignore_eos=True, logprobs=k)) for p, m, k in requests]
    engine.run_until_done()
    greedy = recompute_greedy(tiny_model)
    for i, (prompt, max_tokens, k) in zip(ids, requests):
        out = engine.output(i)
        tokens, logprobs = greedy(prompt, max_tokens)
        assert out.token_ids == tokens, (seed, config, len(prompt), max_tokens)
        if k is not None:
            np.testing.assert_allclose([lp.logprob for lp in out.logprobs], logprobs, atol=1e-4,
                                       err_msg=f"seed {seed}, {config}, prompt of {len(prompt)}")
