"""EAGLE head and draft models on the tiny config with random weights (no SmolLM2 load)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

from infer.cache.contiguous import KVCache
from infer.cache.metadata import AttentionMetadata
from infer.io.tensors import named_params
from infer.model.config import get_config
from infer.model.llama import Llama, rope_frequencies
from infer.spec.draft_model import (DRAFT_CONFIG, draft_own_params, load_draft, save_draft,
                                    self_draft)
from infer.spec.eagle_head import EagleHead, eagle_logits, load_eagle, save_eagle
from infer.spec.training import distill_loss, eagle_loss

CONFIG = get_config("tiny").replace(num_layers=4)


@pytest.fixture(scope="module")
def target() -> Llama:
    model = Llama(CONFIG, rngs=nnx.Rngs(0))
    # Random init leaves norms at 1: perturb them so a swapped or missing norm would show.
    rng = np.random.default_rng(1)
    for name, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if "norm" in name:
            var.set_value(var.get_value() + 0.1 * jnp.asarray(rng.normal(size=var.get_value().shape),
                                                              jnp.float32))
    return model


_call = nnx.jit(lambda module, *args: module(*args))  # eager op-by-op dispatch is slow


@nnx.jit(static_argnums=2)
def _features(target: Llama, tokens: jax.Array, feature_layers: tuple[int, ...] = ()
              ) -> jax.Array:
    b, t = tokens.shape
    cache = KVCache.create(CONFIG.num_layers, b, t, CONFIG.num_kv_heads, CONFIG.head_dim)
    _, hidden, _ = target(tokens, cache, AttentionMetadata.for_prefill([t] * b, t),
                          feature_layers=feature_layers)
    return hidden


@nnx.jit
def _run_head(head: EagleHead, target: Llama, features, tokens) -> jax.Array:
    b, t = tokens.shape
    out, _ = head(features, jnp.asarray(tokens), target.embed, head.create_cache(b, t),
                  AttentionMetadata.for_prefill([t] * b, t))
    return out


def test_eagle_head_shapes_and_causality(target):
    head = EagleHead(CONFIG, rngs=nnx.Rngs(2))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CONFIG.vocab_size, (2, 12))
    features = _features(target, tokens)
    out = _run_head(head, target, features, tokens)
    assert out.shape == (2, 12, CONFIG.hidden_size) and out.dtype == jnp.float32
    assert eagle_logits(target, out).shape == (2, 12, CONFIG.vocab_size)
    # Normalized like the target's final hidden state: RMS over E equals the norm weight's scale.
    unit = out / head.norm.weight[...]
    np.testing.assert_allclose(np.sqrt(np.mean(np.asarray(unit) ** 2, -1)), 1.0, rtol=1e-3)
    # The head owns no vocabulary weights.
    assert all(CONFIG.vocab_size not in v.shape for v in named_params(head).values())

    # Change the inputs from position 7 on: outputs before 7 stay, later ones move.
    tokens2 = tokens.copy()
    tokens2[:, 7:] = (tokens2[:, 7:] + 1) % CONFIG.vocab_size
    features2 = features.at[:, 7:].add(1.0)
    out2 = _run_head(head, target, features2, tokens2)
    np.testing.assert_allclose(out2[:, :7], out[:, :7], rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(out2[:, 7:] - out[:, 7:])).max() > 1e-2

    # Incremental use with the one-layer cache matches the single full call.
    cache = head.create_cache(2, 12)
    first, cache = _call(head, features[:, :5], jnp.asarray(tokens[:, :5]), target.embed, cache,
                        AttentionMetadata.for_prefill([5, 5], 5))
    steps = [first]
    for i in range(5, 12):
        step, cache = _call(head, features[:, i:i + 1], jnp.asarray(tokens[:, i:i + 1]), target.embed,
                           cache, AttentionMetadata.for_decode(jnp.array([i, i])))
        steps.append(step)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), out, rtol=1e-4, atol=1e-4)


def _train(loss_fn, model, frozen_filter, steps: int, lr: float) -> list[float]:
    """`steps` AdamW steps on `loss_fn(model)`; the parameters `frozen_filter` selects stay."""
    graphdef, params, frozen = nnx.split(model, nnx.All(nnx.Param, nnx.Not(frozen_filter)), ...)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, weight_decay=0.0))
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, frozen)))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    return losses


def test_eagle_training_lowers_loss(target):
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, CONFIG.vocab_size, (4, 16))
    features = _features(target, tokens)
    lengths = jnp.array([16, 16, 11, 6])
    head = EagleHead(CONFIG, rngs=nnx.Rngs(4))
    _, first = nnx.jit(eagle_loss, static_argnames="cls_weight")(head, target, features, jnp.asarray(tokens), lengths, cls_weight=1.0)
    assert int(first["count"]) == 15 + 15 + 10 + 5
    losses = _train(lambda h: eagle_loss(h, target, features, jnp.asarray(tokens), lengths,
                                         cls_weight=1.0)[0], head, nnx.Not(nnx.Param), 30, 3e-3)
    assert losses[-1] < 0.6 * losses[0], losses


def test_distillation_lowers_loss_and_keeps_embedding_frozen(target):
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, CONFIG.vocab_size, (4, 16)))
    hidden = _features(target, np.asarray(tokens))
    lengths = jnp.array([16, 12, 16, 9])
    draft = Llama(DRAFT_CONFIG(CONFIG), rngs=nnx.Rngs(6))
    draft.embed.set_value(target.embed.get_value())
    embed_before = np.asarray(draft.embed[...])
    losses = _train(lambda d: distill_loss(d, tokens, hidden, lengths)[0], draft,
                    nnx.PathContains("embed"), 30, 3e-3)
    assert losses[-1] < 0.6 * losses[0], losses
    np.testing.assert_array_equal(np.asarray(draft.embed[...]), embed_before)


def test_eagle_save_load_round_trip(target, tmp_path):
    head = EagleHead(CONFIG, rngs=nnx.Rngs(7))
    path = tmp_path / "eagle.safetensors"
    size = save_eagle(head, path)
    n = sum(x.size for x in named_params(head).values())
    assert n < size <= 2 * n + 4096  # bfloat16 on disk, plus the header
    loaded = load_eagle(CONFIG, path)
    saved = named_params(head)
    for name, value in named_params(loaded).items():
        assert value.dtype == jnp.float32
        want = np.asarray(saved[name]).astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(value), want, err_msg=name)
    # The loaded head computes what the saved one does up to bfloat16 weight rounding.
    tokens = np.random.default_rng(8).integers(0, CONFIG.vocab_size, (1, 8))
    features = _features(target, tokens)
    np.testing.assert_allclose(_run_head(loaded, target, features, tokens),
                               _run_head(head, target, features, tokens), atol=0.1)
    # A draft's file is not a head's.
    save_draft(self_draft(target, 1), tmp_path / "draft.safetensors")
    with pytest.raises(ValueError, match="infer-eagle"):
        load_eagle(CONFIG, tmp_path / "draft.safetensors")


def test_self_draft_shares_arrays_and_equals_first_layers(target):
    n = 2
    draft = self_draft(target, n)
    assert draft.config.num_layers == n and len(draft.layers) == n
    t_params = named_params(target)
    d_params = named_params(draft)
    assert set(d_params) == {k for k in t_params if not k.startswith(("layers.2.", "layers.3."))}
    for name, value in d_params.items():
        assert value is t_params[name], name
        assert value.unsafe_buffer_pointer() == t_params[name].unsafe_buffer_pointer()

    # Equals the target's first n layers, final norm and head, computed by hand.
    tokens = jnp.asarray(np.random.default_rng(9).integers(0, CONFIG.vocab_size, (2, 10)))
    meta = AttentionMetadata.for_prefill([10, 7], 10)
    cache = KVCache.create(n, 2, 10, CONFIG.num_kv_heads, CONFIG.head_dim)
    logits, hidden, _ = _call(draft, tokens, cache, meta)

    @nnx.jit
    def first_layers(target, tokens, meta):
        x = target.embed_tokens(tokens)
        cache = KVCache.create(CONFIG.num_layers, 2, 10, CONFIG.num_kv_heads, CONFIG.head_dim)
        inv_freq = jnp.asarray(rope_frequencies(CONFIG))
        for i in range(n):
            x, cache = target.layers[i](x, i, cache, meta, inv_freq)
        return target.norm(x), target.logits(target.norm(x))

    ref_hidden, ref_logits = first_layers(target, tokens, meta)
    np.testing.assert_allclose(hidden, ref_hidden, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-4)
    # All layers: the target itself.
    full_logits, _, _ = _call(self_draft(target, CONFIG.num_layers), tokens, KVCache.create(
        CONFIG.num_layers, 2, 10, CONFIG.num_kv_heads, CONFIG.head_dim), meta)
    ref_logits, _, _ = _call(target, tokens, KVCache.create(
        CONFIG.num_layers, 2, 10, CONFIG.num_kv_heads, CONFIG.head_dim), meta)
    np.testing.assert_array_equal(full_logits, ref_logits)
    with pytest.raises(ValueError):
        self_draft(target, CONFIG.num_layers + 1)


def test_load_draft_uses_target_embedding(target, tmp_path):
    draft = Llama(DRAFT_CONFIG(CONFIG), rngs=nnx.Rngs(10))
    path = tmp_path / "draft.safetensors"
    size = save_draft(draft, path)
    own = draft_own_params(draft)
    assert "embed" not in own and "norm.weight" in own and "layers.1.mlp.up_proj" in own
    assert size <= 2 * sum(x.size for x in own.values()) + 4096  # no embedding on disk

    loaded = load_draft(target, path, dtype=jnp.float32)
    assert loaded.config.num_layers == DRAFT_CONFIG(CONFIG).num_layers
    assert loaded.embed.get_value() is target.embed.get_value()
    for name, value in draft_own_params(loaded).items():
        want = np.asarray(own[name]).astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(value), want, err_msg=name)
    # It runs, with the target's vocabulary.
    tokens = jnp.asarray([[1, 2, 3, 4]])
    cache = KVCache.create(2, 1, 4, CONFIG.num_kv_heads, CONFIG.head_dim)
    logits, _, _ = _call(loaded, tokens, cache, AttentionMetadata.for_prefill([4], 4))
    assert logits.shape == (1, 4, CONFIG.vocab_size) and bool(jnp.isfinite(logits).all())
    with pytest.raises(ValueError, match="infer-draft"):
        save_eagle(EagleHead(CONFIG, rngs=nnx.Rngs(0)), tmp_path / "e.safetensors")
        load_draft(target, tmp_path / "e.safetensors")


@pytest.mark.parametrize("layers", [(), (1,)])
def test_test_time_passes_equal_incremental_drafting(target, layers):
    """train_eagle's drafted steps (all positions at once) equal drafting with the head's
    cache: real rows 0..i prefilled, then (ĥ_{i+1}, x_{i+2}) decoded at position i + 1, then
    (ĥ_{i+2}, x_{i+3}) at i + 2; for an EAGLE-1 and an EAGLE-3 head (its real rows fused)."""
    from experiments.train_eagle import losses
    from infer.spec.eagle_head import eagle_forward

    b, t = 2, 10
    tokens = jnp.asarray(np.random.default_rng(11).integers(0, CONFIG.vocab_size, (b, t)))
    head = EagleHead(CONFIG, rngs=nnx.Rngs(12), feature_layers=layers)
    if layers:
        head.fuse.set_value(jax.random.normal(jax.random.key(1), head.fuse[...].shape) / 4)
    hidden = _features(target, tokens, layers)

    @nnx.jit
    def passes(head, target, hidden, tokens):
        pred, *_ = eagle_forward(head, target, hidden, tokens, jnp.full((b,), t))
        _, _, later = losses(head, target, hidden, tokens, jnp.full((b,), t),
                             jnp.zeros((b, t), jnp.int32), cls_weight=0.5, step2_weight=0.5,
                             noise=0.0, key=None, drafted_steps=3)
        return pred, [m["predicted"] for m in later]

    pred, (second_all, third_all) = passes(head, target, hidden, tokens)
    assert second_all.shape[1] == t - 2 and third_all.shape[1] == t - 3
    real = nnx.jit(lambda h, x: h.features_in(x))(head, hidden)
    for i in (0, 4, t - 4):
        cache = head.create_cache(b, t)
        _, cache = _call(head, real[:, :i + 1], tokens[:, 1:i + 2], target.embed, cache,
                         AttentionMetadata.for_prefill([i + 1] * b, i + 1))
        second, cache = _call(head, pred[:, i:i + 1], tokens[:, i + 2:i + 3], target.embed,
                              cache, AttentionMetadata.for_decode(jnp.full((b,), i + 1)))
        third, _ = _call(head, second, tokens[:, i + 3:i + 4], target.embed, cache,
                         AttentionMetadata.for_decode(jnp.full((b,), i + 2)))
        np.testing.assert_allclose(second[:, 0], second_all[:, i], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(third[:, 0], third_all[:, i], rtol=1e-4, atol=1e-4)


def test_feature_loss_over_a_draft_vocabulary(target):
    """With the draft vocabulary (the head's CE over a subset of ids): the whole vocabulary in
    id order is the plain loss; a subset's CE is the cross-entropy of the two softmaxes over
    those ids (numpy, apart from the loss); `hit` compares target ids with target_argmax."""
    from infer.spec.training import feature_loss

    rng = np.random.default_rng(13)
    b, t, e = 2, 6, CONFIG.hidden_size
    predicted = jnp.asarray(rng.normal(size=(b, t, e)), jnp.float32)
    wanted = jnp.asarray(rng.normal(size=(b, t, e)), jnp.float32)
    mask = jnp.asarray(rng.random((b, t)) < 0.8, jnp.float32)
    rows = target.embed[...]
    every = (rows, jnp.arange(CONFIG.vocab_size, dtype=jnp.int32))
    plain, m_plain = feature_loss(target, predicted, wanted, mask, 0.5)
    full, m_full = feature_loss(target, predicted, wanted, mask, 0.5, vocab=every)
    np.testing.assert_allclose(float(full), float(plain), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(m_full["hit"]), np.asarray(m_plain["hit"]))

    ids = np.sort(rng.choice(CONFIG.vocab_size, 40, replace=False)).astype(np.int32)
    subset = (jnp.take(rows, jnp.asarray(ids), axis=0), jnp.asarray(ids))
    argmax = jnp.asarray(rng.choice(ids, (b, t)), jnp.int32)
    _, m = feature_loss(target, predicted, wanted, mask, 0.5, vocab=subset, target_argmax=argmax)
    w = np.asarray(rows)[ids]
    draft = np.asarray(predicted) @ w.T
    want = np.asarray(wanted) @ w.T
    p = np.exp(want - want.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    log_q = draft - draft.max(-1, keepdims=True)
    log_q -= np.log(np.exp(log_q).sum(-1, keepdims=True))
    ce = -(p * log_q).sum(-1)
    m_np = np.asarray(mask)
    np.testing.assert_allclose(float(m["ce"]), (ce * m_np).sum() / m_np.sum(), rtol=1e-5)
    hit = ids[draft.argmax(-1)] == np.asarray(argmax)
    np.testing.assert_array_equal(np.asarray(m["hit"]), hit.astype(np.float32))
