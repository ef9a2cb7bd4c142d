"""KV format names and the Hadamard rotation are settled when the cache is configured: one alias
table for every layer, and a rotation for every even head dim (or a clear error), never a
silent skip or a crash inside the first jitted write."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from infer.cache import budget as memory
from infer.cache.metadata import AttentionMetadata
from infer.cache.paged import PagedKVCache, _hadamard, hadamard_rotate
from infer.engine.engine import Engine, EngineConfig
from infer.model.config import get_config
from infer.model.llama import Llama
from kernels_pallas import kv_quant

TINY = get_config("tiny")


def test_hadamard_is_orthonormal_for_every_even_head_dim() -> None:
    for d in range(2, 258, 2):
        h = _hadamard(d)
        np.testing.assert_allclose(h @ h.T, np.eye(d), atol=1e-12, err_msg=f"d={d}")
        # It mixes channels (an identity would pass orthonormality and do nothing): each row
        # spreads over the largest power-of-two block dividing d.
        assert (np.count_nonzero(h, axis=1) == d & -d).all(), d


@pytest.mark.parametrize("d", [2, 6, 48, 64, 80, 96, 112, 256])
def test_hadamard_rotate_round_trips(d: int) -> None:
    x = np.random.default_rng(d).standard_normal((3, d)).astype(np.float32)
    back = hadamard_rotate(hadamard_rotate(jnp.asarray(x)), inverse=True)
    np.testing.assert_allclose(np.asarray(back), x, atol=1e-5)


@pytest.mark.parametrize("d", [48, 80, 96])
def test_non_power_of_two_head_dims_are_rotated_and_it_helps(d: int) -> None:
    """The default rotates every scaled format's cache (head dims like 80 and 96 used to be
    skipped without a word), and the block rotation still spreads an outlier channel."""
    cache = PagedKVCache.create(1, 2, 4, 1, d, "int8")
    assert cache.rotate
    rng = np.random.default_rng(d)
    x = rng.standard_normal((64, d)).astype(np.float32)
    x[:, 5] *= 40.0  # one outlier channel sets every vector's int8 scale

    def error(rotate: bool) -> float:
        y = hadamard_rotate(jnp.asarray(x)) if rotate else jnp.asarray(x)
        data, scales = kv_quant.quantize(y, "int8")
        back = kv_quant.dequantize(data, scales, "int8")
        back = hadamard_rotate(back, inverse=True) if rotate else back
        return float(np.sqrt(np.mean((np.asarray(back) - x) ** 2)))

    assert error(True) < 0.5 * error(False)  # measured: 3.4x (d=48) to 4.5x (d=96) smaller


def test_rotated_cache_with_a_non_power_of_two_head_dim_attends_exactly() -> None:
    d, k_heads, h_heads, t = 48, 2, 4, 6
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.standard_normal((1, t, k_heads, d)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((1, t, h_heads, d)), jnp.float32)
    meta = AttentionMetadata.for_prefill(jnp.asarray([t]), t, page_tables=jnp.asarray([[0, 1]]))

    def attend(rotate: bool) -> np.ndarray:
        cache = PagedKVCache.create(1, 2, 4, k_heads, d, "float32", rotate=rotate)
        return np.asarray(cache.write(0, k, v, meta).attend(0, q, meta))

    np.testing.assert_allclose(attend(True), attend(False), atol=1e-5)


@pytest.mark.parametrize("d", [1, 3, 7, 33])
def test_rotation_on_an_odd_head_dim_fails_when_the_cache_is_created(d: int) -> None:
    with pytest.raises(ValueError, match=f"Hadamard rotation needs an even head dim, got {d}"):
        PagedKVCache.create(1, 2, 4, 1, d, "int8", rotate=True)
    assert not PagedKVCache.create(1, 2, 4, 1, d, "int8").rotate  # the default: no rotation


@pytest.mark.parametrize("alias", sorted(kv_quant.KV_FORMAT_ALIASES))
def test_alias_reaches_the_cache_as_its_canonical_format(alias: str) -> None:
    name = kv_quant.KV_FORMAT_ALIASES[alias]
    cache = PagedKVCache.create(1, 2, 4, 1, 16, alias, num_windows=1)
    want = PagedKVCache.create(1, 2, 4, 1, 16, name, num_windows=1)
    assert cache.kv_format == name and cache.rotate == want.rotate
    assert cache.num_bytes == want.num_bytes


def test_engine_accepts_the_fp8_alias() -> None:
    model = Llama(TINY, jnp.float32, nnx.Rngs(0))
    engine = Engine(model, None, EngineConfig(kv_cache_dtype="fp8", max_num_seqs=2,
                                              max_prefill_tokens=16, max_model_len=32))
    assert engine.runner.cache.kv_format == "float8_e4m3fn"
    assert memory.kv_bytes_per_token(TINY, "fp8") == memory.kv_bytes_per_token(TINY, "float8_e4m3fn")


def test_memory_accounting_and_the_cache_share_one_alias_table() -> None:
    """Every name memory accounting takes, the cache takes with the same meaning, and back."""
    names = set(kv_quant.SUPPORTED_KV_FORMATS + kv_quant.PAGE_FORMATS)
    names |= set(kv_quant.KV_FORMAT_ALIASES) | set(getattr(memory, "KV_FORMAT_ALIASES", {}))
    for name in sorted(names):
        assert memory.kv_format_name(name) == kv_quant.resolve_kv_format(
            name, page_formats=True), name
    for bad in ("fp4", "float64", "FP8"):
        for resolve in (memory.kv_format_name, kv_quant.resolve_kv_format):
            with pytest.raises(ValueError, match="unsupported"):
                resolve(bad)
