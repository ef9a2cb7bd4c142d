"""train_eagle's held-out figures on a head whose every draft is right: each top-1 is 1."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import infer.io.loader
from experiments import train_eagle
from infer.cache.contiguous import KVCache
from infer.cache.metadata import AttentionMetadata
from infer.model.config import get_config
from infer.model.llama import Llama
from infer.spec.eagle_head import EagleHead, save_eagle

CONFIG = get_config("tiny")


def _spec_data(path, target: Llama, rng: np.random.Generator, n: int, width: int) -> None:
    """A spec_data file of random rows whose target argmax is id 0 everywhere."""
    lengths = rng.integers(8, width + 1, n).astype(np.int32)
    prompt_lens = rng.integers(1, lengths - 4).astype(np.int32)  # drafted steps on generations
    tokens = np.where(np.arange(width)[None] < lengths[:, None],
                      rng.integers(1, CONFIG.vocab_size, (n, width)), 0).astype(np.int32)
    cache = KVCache.create(CONFIG.num_layers, n, width, CONFIG.num_kv_heads, CONFIG.head_dim)
    _, hidden, _ = target(jnp.asarray(tokens), cache,
                          AttentionMetadata.for_prefill(jnp.asarray(lengths), width))
    np.savez(path, tokens=tokens, hidden=np.asarray(hidden).astype(np.float16), lengths=lengths,
             prompt_lens=prompt_lens, chat=np.zeros(n, bool), greedy=np.ones(n, bool),
             self_instruct=np.zeros(n, bool), target_argmax=np.zeros((n, width), np.int32),
             meta=np.array(json.dumps({"experiment": "spec_data"})))


@pytest.mark.parametrize("seed", range(2))
def test_every_held_out_top1_of_a_head_always_right_is_one(tmp_path, monkeypatch,
                                                           seed: int) -> None:
    # The head's output norm is 0: its logits are all 0 and it drafts id 0, the target's argmax
    # at every position, at every drafted step. The generated-token variants of drafted steps 2
    # and 3 divided by positions with no target s tokens on (0.92-0.95 here before).
    rng = np.random.default_rng(seed)
    target = Llama(CONFIG, jnp.float32, nnx.Rngs(seed))
    monkeypatch.setattr(infer.io.loader, "load", lambda name, dtype: (CONFIG, target, None))
    _spec_data(tmp_path / "data.npz", target, rng, n=30, width=24)
    head = EagleHead(CONFIG, rngs=nnx.Rngs(seed))
    head.norm.weight.set_value(jnp.zeros_like(head.norm.weight.get_value()))
    save_eagle(head, str(tmp_path / "init.safetensors"))
    rows = train_eagle.run(
        data=str(tmp_path / "data.npz"), epochs=0, batch_size=int(rng.integers(2, 5)), lr=1e-3,
        warmup=0.0, weight_decay=0.0, clip=1.0, cls_weight=0.5, step2_weight=0.5, noise=0.0,
        seed=seed, max_sequences=0, weights=str(tmp_path / "head.safetensors"),
        out=str(tmp_path / "train.jsonl"), init=str(tmp_path / "init.safetensors"), ttt_steps=3)
    figures = {k: v for k, v in rows[0].items() if k.startswith("heldout_top1")}
    assert {"heldout_top1_both_generated", "heldout_top1_all3_generated"} <= figures.keys()
    assert figures == {k: 1.0 for k in figures}
