"""`dense`, the one place a weight multiplies activations: a one-row 16-bit product (which
XLA:CPU would otherwise send down a slow path that upcasts the whole weight) is padded to two
rows, and a float32 product of a few rows with a [N, K] weight is a multiply-and-reduce on CPU;
neither may change any value beyond float32 rounding, nor any shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infer.model.llama import FEW_ROWS, _reduces_few_rows, dense

EQUATIONS = [("bte,ef->btf", (1, 1, 48), (48, 80)), ("btf,fe->bte", (1, 1, 80), (80, 48)),
             ("...e,ve->...v", (1, 1, 48), (96, 48)), ("...e,ve->...v", (1, 48), (96, 48)),
             ("...e,ve->...v", (48,), (96, 48))]  # a feature vector: the tree's root logits


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("equation,x_shape,w_shape", EQUATIONS)
def test_one_row_products_match_the_float32_reference(dtype, equation, x_shape, w_shape) -> None:
    for seed in range(5):
        kx, kw = jax.random.split(jax.random.key(seed))
        x = jax.random.normal(kx, x_shape, jnp.float32)
        w = jax.random.normal(kw, w_shape, jnp.float32).astype(dtype)
        got = jax.jit(lambda x, w: dense(x, w, equation))(x, w)
        # The same product in float32 over the 16-bit values: only the accumulation order differs.
        want = jnp.einsum(equation, x.astype(dtype).astype(jnp.float32), w.astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)
        assert got.shape == want.shape and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


def test_a_one_row_product_equals_its_row_in_a_two_row_batch() -> None:
    """The padded row is dropped, not mixed in: row 0 of a real two-row batch is the same."""
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (2, 1, 64), jnp.float32)
    w = jax.random.normal(kw, (64, 32), jnp.float32).astype(jnp.bfloat16)
    one = jax.jit(lambda x, w: dense(x, w, "bte,ef->btf"))(x[:1], w)
    two = jax.jit(lambda x, w: dense(x, w, "bte,ef->btf"))(x, w)
    np.testing.assert_allclose(np.asarray(one), np.asarray(two[:1]), rtol=1e-6, atol=1e-6)


def test_few_row_products_match_the_einsum_over_random_rows_and_shapes() -> None:
    """Random row counts (1 to FEW_ROWS + 2, as leading shapes a step gives: [M, K], [1, M, K],
    [B, T, K]) and weight shapes, in both weight layouts: the product equals the float32 einsum
    to float32 rounding, with its shape and dtype. The multiply-and-reduce is taken exactly for
    2..FEW_ROWS rows of a float32 [N, K] weight on CPU."""
    rng = np.random.default_rng(0)
    cpu = jax.default_backend() == "cpu"
    taken = 0
    for trial in range(60):
        m = int(rng.integers(1, FEW_ROWS + 3))
        k, n = int(rng.integers(1, 200)), int(rng.integers(1, 300))
        lead = [(m,), (1, m), (m, 1)][trial % 3]
        if trial % 4 == 3 and m % 2 == 0:
            lead = (2, m // 2)
        transposed = trial % 5 == 4  # [K, N]: "...e,ef->...f", never reduced
        equation = "...e,ef->...f" if transposed else "...e,ve->...v"
        x = jnp.asarray(rng.standard_normal((*lead, k)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((k, n) if transposed else (n, k)), jnp.float32)
        reduced = _reduces_few_rows(x, w, equation)
        assert reduced == (cpu and not transposed and 2 <= m <= FEW_ROWS)
        taken += reduced
        got = jax.jit(lambda x, w: dense(x, w, equation))(x, w)
        want = jnp.einsum(equation, x, w, precision=jax.lax.Precision.HIGHEST)
        assert got.shape == want.shape == (*lead, n) and got.dtype == jnp.float32
        scale = np.sqrt(k) * 4  # |sum of k products of unit normals| bound, for the rounding
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0,
                                   atol=scale * 4 * np.finfo(np.float32).eps)
    assert taken or not cpu


def test_the_reduction_is_only_for_float32_weights_stored_n_by_k() -> None:
    x = jnp.ones((3, 16), jnp.float32)
    assert not _reduces_few_rows(x, jnp.ones((32, 16), jnp.bfloat16), "...e,ve->...v")
    assert not _reduces_few_rows(x, jnp.ones((16, 32), jnp.float32), "...e,ef->...f")
    assert not _reduces_few_rows(x[None], jnp.ones((16, 32), jnp.float32), "bte,ef->btf")
    assert not _reduces_few_rows(x[:1], jnp.ones((32, 16), jnp.float32), "...e,ve->...v")


def test_same_shape_products_in_one_program_never_materialize_the_broadcast() -> None:
    """Two few-row products with one weight in one program (a draft loop's steps): no
    top-level array of the broadcast's [N, M, K] size may appear in the compiled program (XLA
    merged the two broadcasts and wrote that array out, ~10x the products' time on SmolLM2)."""
    if jax.default_backend() != "cpu":
        pytest.skip("the multiply-and-reduce path is CPU's")
    n, k = 4096, 64
    rng = np.random.default_rng()
    w = jnp.asarray(rng.normal(size=(n, k)), jnp.float32)
    for m in (2, 5):
        x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)

        def two_steps(x, w):
            y = dense(x, w, "be,ve->bv")
            return dense(x + y[:, :k], w, "be,ve->bv")

        text = jax.jit(two_steps).lower(x, w).compile().as_text()
        entry = text[text.index("ENTRY"):]
        assert f"f32[{n},{m},{k}]" not in entry and f"f32[{m},{n},{k}]" not in entry, m
        want = (x + (x @ w.T)[:, :k]) @ w.T
        np.testing.assert_allclose(np.asarray(two_steps(x, w)), np.asarray(want), rtol=2e-4,
                                   atol=2e-3)


def _tiny_logits(model, tokens: np.ndarray) -> np.ndarray:
    """The `tiny` model's logits over a prefill of `tokens` [B, T] on a contiguous cache."""
    from infer.cache.contiguous import KVCache
    from infer.cache.metadata import AttentionMetadata

    config, (b, t) = model.config, tokens.shape
    cache = KVCache.create(config.num_layers, b, t, config.num_kv_heads, config.head_dim)
    return np.asarray(model(jnp.asarray(tokens), cache,
                            AttentionMetadata.for_prefill(jnp.full((b,), t), t))[0])


def test_tiled_weights_give_the_logits_of_the_tiles_over_the_weights_as_stored(monkeypatch
                                                                              ) -> None:
    """`tile_weights` packs every layer's projections into the CPU kernel's tile layout, in a copy:
    the model keeps its weights, the copy shares the others (embedding, norms). The copy's
    logits are the model's bit for bit where the model's own products take the tiles too
    (tiles_from 1), so nothing is lost or reordered in the packing; with INFER_TILED_WEIGHTS=0
    a model is returned as it is; placing a tiled model on a mesh is refused."""
    from flax import nnx

    from infer.model.config import get_config
    from infer.model.llama import Llama, is_tiled, tile_weights
    from kernels_cpu import dense as dense_cpu

    if not dense_cpu.packs(jnp.zeros((32, 32), jnp.bfloat16)):
        pytest.skip("weights are packed only where the CPU kernel runs AMX tiles")
    config = get_config("tiny")
    model = Llama(config, jnp.bfloat16, nnx.Rngs(int(np.random.SeedSequence().entropy % 2**31)))
    tiled = tile_weights(model)
    for layer, tiled_layer in zip(model.layers, tiled.layers):
        for mine, theirs in zip((*layer.attn.projections(), *layer.mlp.projections()),
                                (*tiled_layer.attn.projections(), *tiled_layer.mlp.projections())):
            assert mine.get_value().ndim == 2 and dense_cpu.is_packed(theirs.get_value())
            np.testing.assert_array_equal(np.asarray(dense_cpu.unpack(theirs.get_value())),
                                          np.asarray(mine.get_value()))
        assert tiled_layer.input_norm.weight.get_value() is layer.input_norm.weight.get_value()
    assert tiled.embed.get_value() is model.embed.get_value()

    monkeypatch.setitem(dense_cpu.TILES_FROM, "kn", 1)
    tokens = np.random.default_rng().integers(0, config.vocab_size, (2, 24))
    np.testing.assert_array_equal(_tiny_logits(tiled, tokens), _tiny_logits(model, tokens))
    monkeypatch.setattr(dense_cpu, "TILED_WEIGHTS", False)
    assert tile_weights(model) is model
    # The mesh's rules name an [in, out] weight's dims: a tiled model is for one device.
    from infer.parallel.placement import place_model
    assert is_tiled(tiled) and not is_tiled(model)
    with pytest.raises(ValueError, match="tile layout"):
        place_model(tiled, jax.make_mesh((1, 1), ("data", "model")))


def test_float32_strips_give_the_models_logits(monkeypatch) -> None:
    """A float32 model's copy, its projections as strips, gives the model's logits bit for bit
    where its products take the kernel (ROWS); with INFER_TILED_WEIGHTS=0 the model is returned
    as it is; placing it on a mesh is refused. Wherever the kernel runs, AMX or not."""
    from flax import nnx

    from infer.model.config import get_config
    from infer.model.llama import Llama, is_tiled, tile_weights
    from kernels_cpu import dense as dense_cpu

    if not dense_cpu.packs(jnp.zeros((32, 32), jnp.float32)):
        pytest.skip("float32 weights are stored as strips only where the CPU kernel runs")
    config = get_config("tiny")
    model32 = Llama(config, jnp.float32, nnx.Rngs(0))
    strips = tile_weights(model32)
    assert all(dense_cpu.is_packed(w.get_value()) and w.get_value().ndim == 3
               for layer in strips.layers for w in layer.mlp.projections())
    tokens = np.random.default_rng().integers(0, config.vocab_size, (2, 24))
    assert 48 in dense_cpu.ROWS[("kn", jnp.dtype(jnp.float32))]  # 2 x 24 rows: the kernel's
    np.testing.assert_array_equal(_tiny_logits(strips, tokens), _tiny_logits(model32, tokens))
    from infer.parallel.placement import place_model
    assert is_tiled(strips)
    with pytest.raises(ValueError, match="tile layout"):
        place_model(strips, jax.make_mesh((1, 1), ("data", "model")))
    monkeypatch.setattr(dense_cpu, "TILED_WEIGHTS", False)
    assert tile_weights(model32) is model32
