"""The Flax Llama against HF transformers on tiny random checkpoints written with save_pretrained:
GQA ratios, tied and untied embeddings, Llama-3 RoPE scaling, and the KV cache."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from infer.cache.contiguous import KVCache
from infer.cache.metadata import AttentionMetadata
from infer.model.config import get_config
from infer.model.llama import Llama
from tests.hf_util import hf_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LLAMA3_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=32)

CASES = {
    # name: (heads, kv heads, tied, rope scaling)
    "mha-untied": (4, 4, False, None),
    "gqa3-tied": (6, 2, True, None),
    "gqa4-untied": (8, 2, False, None),
    "gqa3-llama3-rope": (6, 2, False, LLAMA3_SCALING),
}


def _save_tiny(tmp_path_factory, name: str) -> tuple[str, object]:
    heads, kv_heads, tied, scaling = CASES[name]
    torch.manual_seed(hash(name) % 2**31)
    cfg = transformers.LlamaConfig(
        vocab_size=320, hidden_size=16 * heads, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
        rope_theta=10000.0, tie_word_embeddings=tied, rope_scaling=scaling, rms_norm_eps=1e-6)
    model = transformers.LlamaForCausalLM(cfg).eval()
    # Random init leaves norms at 1: perturb them so a swapped norm weight would show.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path, safe_serialization=True)
    return str(path), model


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny(request, tmp_path_factory):
    path, hf = _save_tiny(tmp_path_factory, request.param)
    config, model, _ = _load_no_tokenizer(path)
    return config, model, hf


def _load_no_tokenizer(path: str):
    from infer.io.checkpoint import read_hf_dir
    from infer.io.hf_weights import model_from_hf_tensors
    from infer.model.config import LlamaConfig
    ckpt = read_hf_dir(path)
    config = LlamaConfig.from_hf_dict(ckpt.hf_config)
    return config, model_from_hf_tensors(config, ckpt.tensors), None


def _forward(model: Llama, tokens: np.ndarray) -> np.ndarray:
    c = model.config
    b, t = tokens.shape
    cache = KVCache.create(c.num_layers, b, t, c.num_kv_heads, c.head_dim)
    logits, _, _ = model(jnp.asarray(tokens), cache,
                         AttentionMetadata.for_prefill(jnp.full((b,), t), t))
    return np.asarray(logits)


def test_logits_match_hf(tiny) -> None:
    config, model, hf = tiny
    tokens = np.random.RandomState(1).randint(0, config.vocab_size, (1, 100))
    ours = _forward(model, tokens)[0]
    ref = hf_logits(hf, tokens[0].tolist())
    assert np.abs(ours - ref).max() <= 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_config_read_from_checkpoint(tiny) -> None:
    config, _, hf = tiny
    assert config.num_kv_heads == hf.config.num_key_value_heads
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert (config.rope_scaling is not None) == (hf.config.rope_scaling is not None
                                                 and "llama3" in str(hf.config.rope_scaling))


def test_incremental_decode_equals_full_forward(tiny) -> None:
    """Prefill part of a batch of rows of different lengths, then decode one token at a time:
    every step's logits equal the full forward's at that position."""
    config, model, _ = tiny
    rng = np.random.RandomState(2)
    tokens = rng.randint(0, config.vocab_size, (3, 48))
    full = _forward(model, tokens)
    prompt_lens = np.array([5, 17, 30])
    cache = KVCache.create(config.num_layers, 3, 64, config.num_kv_heads, config.head_dim)
    padded = np.where(np.arange(32)[None] < prompt_lens[:, None], tokens[:, :32], 0)
    meta = AttentionMetadata.for_prefill(jnp.asarray(prompt_lens), 32)
    logits, _, cache = model(jnp.asarray(padded), cache, meta)
    for row, n in enumerate(prompt_lens):
        np.testing.assert_allclose(np.asarray(logits)[row, :n], full[row, :n], atol=1e-5)
    lengths = prompt_lens.copy()
    for _ in range(48 - 30):
        step_tokens = tokens[np.arange(3), lengths][:, None]
        logits, _, cache = model(jnp.asarray(step_tokens), cache,
                                 AttentionMetadata.for_decode(jnp.asarray(lengths)))
        np.testing.assert_allclose(np.asarray(logits)[:, 0], full[np.arange(3), lengths], atol=1e-5)
        lengths += 1


def test_chunked_prefill_equals_one_prefill(tiny) -> None:
    """Feeding a prompt in chunks over an existing cache gives the same logits as one pass."""
    config, model, _ = tiny
    tokens = np.random.RandomState(3).randint(0, config.vocab_size, (2, 40))
    full = _forward(model, tokens)
    cache = KVCache.create(config.num_layers, 2, 64, config.num_kv_heads, config.head_dim)
    for start in range(0, 40, 16):
        n = min(16, 40 - start)
        chunk = np.zeros((2, 16), np.int64)
        chunk[:, :n] = tokens[:, start:start + n]
        meta = AttentionMetadata.for_prefill(jnp.full((2,), n), 16, cached=jnp.full((2,), start))
        logits, _, cache = model(jnp.asarray(chunk), cache, meta)
        np.testing.assert_allclose(np.asarray(logits)[:, :n], full[:, start:start + n], atol=1e-5)


def test_bfloat16_weights_track_float32() -> None:
    """bfloat16 weights with float32 accumulation stay close to the float32 model."""
    config = get_config("tiny")
    model32 = Llama(config, jnp.float32, nnx.Rngs(0))
    model16 = Llama(config, jnp.bfloat16, nnx.Rngs(0))
    tokens = np.random.RandomState(4).randint(0, config.vocab_size, (2, 24))
    a, b = _forward(model32, tokens), _forward(model16, tokens)
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max()
    assert np.abs(a - b).max() > 0  # really ran in a different precision
    assert (a.argmax(-1) == b.argmax(-1)).mean() > 0.9
