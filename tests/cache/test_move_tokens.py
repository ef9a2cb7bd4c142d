"""PagedKVCache.move_tokens: single token slots moved within a sequence (tree speculation's
compaction), checked bit for bit against a NumPy gather-then-scatter over the raw pools."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infer.cache import kivi
from infer.cache.metadata import AttentionMetadata
from infer.cache.paged import PagedKVCache

LAYERS, HEADS, HEAD_DIM, G = 2, 2, 8, 4
FORMATS = ("float32", "bfloat16", "fp8", "int8", "int4")


def _pools(cache: PagedKVCache) -> dict[str, np.ndarray]:
    """Every stored array, by name, as host copies of its raw (held) bits."""
    out = {}
    for name in ("k", "v", "k_scales", "v_scales"):
        for layer, pool in enumerate(getattr(cache, name) or ()):
            out[f"{name}[{layer}]"] = np.array(pool)
    return out


def _filled(kv_format: str, num_pages: int, tables: np.ndarray, seed: int) -> PagedKVCache:
    """A cache whose rows' pages all hold random tokens, written through `write`."""
    cache = PagedKVCache.create(LAYERS, num_pages, G, HEADS, HEAD_DIM, kv_format=kv_format)
    b, n = tables.shape
    t = n * G
    meta = AttentionMetadata.for_prefill(jnp.full((b,), t), t, cached=jnp.zeros((b,)),
                                         page_tables=jnp.asarray(tables, jnp.int32))
    keys = jax.random.split(jax.random.key(seed), 2 * LAYERS)
    for layer in range(LAYERS):
        k = 3 * jax.random.normal(keys[2 * layer], (b, t, HEADS, HEAD_DIM), jnp.float32)
        v = 3 * jax.random.normal(keys[2 * layer + 1], (b, t, HEADS, HEAD_DIM), jnp.float32)
        cache = cache.write(layer, k, v, meta)
    return cache


def _host_move(pools: dict[str, np.ndarray], tables: np.ndarray, src: np.ndarray,
               dst: np.ndarray, valid: np.ndarray) -> dict[str, np.ndarray]:
    """The model: gather every moved row from the old pools, then write them to copies."""
    width = tables.shape[1]
    inside = lambda s: 0 <= s < width * G
    moves = [(b, src[b, t], dst[b, t]) for b in range(src.shape[0]) for t in range(src.shape[1])
             if valid[b, t] and inside(src[b, t]) and inside(dst[b, t])]
    out = {}
    for name, pool in pools.items():
        rows = [pool[tables[b, s // G], :, s % G].copy() for b, s, _ in moves]  # gather all first
        out[name] = pool.copy()
        for (b, _, d), row in zip(moves, rows):
            out[name][tables[b, d // G], :, d % G] = row
    return out


_move = jax.jit(lambda cache, tables, src, dst, valid: cache.move_tokens(tables, src, dst, valid))


def _run(cache: PagedKVCache, tables: np.ndarray, src: np.ndarray, dst: np.ndarray,
         valid: np.ndarray) -> None:
    before = _pools(cache)
    moved = _move(cache, jnp.asarray(tables, jnp.int32), jnp.asarray(src, jnp.int32),
                  jnp.asarray(dst, jnp.int32), jnp.asarray(valid))
    assert moved.kv_format == cache.kv_format
    after = _pools(moved)
    expected = _host_move(before, tables, src, dst, valid)
    assert after.keys() == expected.keys()
    for name in expected:
        assert after[name].dtype == before[name].dtype, name
        np.testing.assert_array_equal(after[name], expected[name], err_msg=name)


@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("seed", range(12))
def test_move_matches_host_gather_then_scatter(kv_format: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    b, n, t = 3, 3, 7
    num_pages = b * n + 2  # two pages no row owns
    # Each row owns its own random pages, in random order.
    tables = rng.permutation(num_pages)[:b * n].reshape(b, n)
    cache = _filled(kv_format, num_pages, tables, seed)
    room = n * G + G  # slots past the table (the last G) must write nothing
    dst = np.stack([rng.permutation(room)[:t] for _ in range(b)])  # distinct within a row
    # Half the sources are other entries' destinations: moves onto slots others leave.
    src = np.where(rng.random((b, t)) < 0.5, np.roll(dst, 1, axis=1),
                   rng.integers(0, room, (b, t)))
    valid = rng.random((b, t)) < 0.7
    _run(cache, tables, src, dst, valid)


@pytest.mark.parametrize("kv_format", FORMATS)
def test_swap_and_shift_gather_before_writing(kv_format: str) -> None:
    """A swap and a shift by one, either of which any write before the last read would break."""
    tables = np.asarray([[4, 1], [0, 5]])
    cache = _filled(kv_format, 6, tables, 1)
    src = np.asarray([[2, 6, 0, 1, 3], [1, 2, 3, 4, 5]])
    dst = np.asarray([[6, 2, 1, 3, 4], [0, 1, 2, 3, 4]])
    _run(cache, tables, src, dst, np.ones_like(src, bool))
    moved = _move(cache, jnp.asarray(tables, jnp.int32), jnp.asarray(src, jnp.int32),
                  jnp.asarray(dst, jnp.int32), jnp.ones(src.shape, bool))
    k = np.asarray(cache.k[1])
    # Row 0's slots 2 (page 4) and 6 (page 1) traded places.
    np.testing.assert_array_equal(np.asarray(moved.k[1])[1, :, 2], k[4, :, 2])
    np.testing.assert_array_equal(np.asarray(moved.k[1])[4, :, 2], k[1, :, 2])


@pytest.mark.parametrize("kv_format", FORMATS)
def test_slots_past_the_table_change_nothing(kv_format: str) -> None:
    """Sources or destinations at or past the row's table width (or negative) move nothing,
    even onto pages other rows own or pages past the pool."""
    tables = np.asarray([[2, 0], [3, 1]])
    cache = _filled(kv_format, 5, tables, 3)
    width = tables.shape[1] * G
    src = np.asarray([[width, 1, width + 5, -1], [0, width + G, 2, 3]])
    dst = np.asarray([[0, width, 2, 3], [width + 1, 1, 4 * width, -3]])
    before = _pools(cache)
    moved = _move(cache, jnp.asarray(tables, jnp.int32), jnp.asarray(src, jnp.int32),
                  jnp.asarray(dst, jnp.int32), jnp.ones(src.shape, bool))
    for name, pool in _pools(moved).items():
        np.testing.assert_array_equal(pool, before[name], err_msg=name)


def test_invalid_entries_change_nothing() -> None:
    tables = np.asarray([[1, 0]])
    cache = _filled("int8", 2, tables, 5)
    before = _pools(cache)
    moved = _move(cache, jnp.asarray(tables, jnp.int32), jnp.asarray([[0, 1, 2]], jnp.int32),
                  jnp.asarray([[5, 6, 7]], jnp.int32), jnp.zeros((1, 3), bool))
    for name, pool in _pools(moved).items():
        np.testing.assert_array_equal(pool, before[name], err_msg=name)


def test_kivi_cannot_move_single_tokens() -> None:
    kivi.check_geometry(HEAD_DIM, G)  # a geometry the format accepts: only the move refuses
    cache = PagedKVCache.create(LAYERS, 4, G, HEADS, HEAD_DIM, kv_format=kivi.KIVI_FORMAT,
                                num_windows=1)
    slots = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="per channel"):
        cache.move_tokens(jnp.asarray([[0, 1]], jnp.int32), slots, slots + 1,
                          jnp.ones((1, 2), bool))
