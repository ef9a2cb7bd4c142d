"""`dense`, the one place a weight multiplies activations: a one-row 16-bit product (which
XLA:CPU would otherwise send down a slow path that upcasts the whole weight) is padded to two
rows, and the padding must not change any value or shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infer.model.llama import dense

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
