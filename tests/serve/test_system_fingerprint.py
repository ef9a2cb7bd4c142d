"""OpenAI's system_fingerprint: equal for engines that produce the same tokens for a seeded
request, different when anything that decides them differs."""

from __future__ import annotations

import dataclasses
import random
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from infer.engine.engine import Engine, EngineConfig
from infer.model.llama import Llama
from infer.platform import git_revision
from infer.serve.app import system_fingerprint

# Config changes that change outputs or how they are computed, each from the defaults below.
CHANGES = [dict(kv_cache_dtype="int8"), dict(page_size=16), dict(max_num_seqs=3),
           dict(max_model_len=96), dict(scheduler="static"), dict(enable_prefix_caching=True),
           dict(mixed_steps=True), dict(max_prefill_tokens=16), dict(async_scheduling=False)]
BASE = dict(page_size=8, max_num_seqs=2, max_prefill_tokens=32, max_model_len=64)


def _fingerprint(model, **config) -> str:
    return system_fingerprint(Engine(model, None, EngineConfig(**{**BASE, **config})))


@pytest.mark.parametrize("seed", range(2))
def test_fingerprints_tell_configs_apart(tiny_model, seed: int) -> None:
    """Random subsets of the changes: equal configs (built anew) give equal fingerprints, and
    every pair of different configs different ones."""
    rng = random.Random(seed)
    subsets = {frozenset(rng.sample(range(len(CHANGES)), rng.randint(0, 2))) for _ in range(5)}
    seen: dict[str, frozenset] = {}
    for subset in subsets:
        config = {k: v for i in subset for k, v in CHANGES[i].items()}
        fingerprint = _fingerprint(tiny_model, **config)
        assert fingerprint == _fingerprint(tiny_model, **config)
        assert fingerprint not in seen, (subset, seen.get(fingerprint))
        seen[fingerprint] = subset
        assert re.fullmatch(rf"infer-{re.escape(git_revision())}-[0-9a-f]{{12}}", fingerprint)


def test_the_weights_dtype_and_the_model_change_it(tiny_model) -> None:
    plain = _fingerprint(tiny_model)
    graph, state = nnx.split(tiny_model)
    as_bf16 = nnx.merge(graph, jax.tree.map(lambda x: x.astype(jnp.bfloat16), state))
    assert _fingerprint(as_bf16) != plain
    deeper = dataclasses.replace(tiny_model.config, num_layers=tiny_model.config.num_layers + 1)
    assert _fingerprint(Llama(deeper, jnp.float32, nnx.Rngs(0))) != plain
