import jax.numpy as jnp
import numpy as np
import pytest

from experiments.int4_keys import Scheme, fake_quantize
from infer.cache.paged import hadamard_rotate
from kernels_pallas import kv_quant


def test_scheme_parsing_and_bytes() -> None:
    assert Scheme.parse("token:32") == Scheme("token", 32, rotate=True)
    assert Scheme.parse("channel:16+mean") == Scheme("channel", 16, mean=True)
    # The int4 format's cost (D = 64): 32 bytes of nibbles, two (scale, low) pairs.
    assert Scheme.parse("token:32").bytes_per_token(64) == 40 == kv_quant.bytes_per_token_per_head(
        64, "int4")
    assert Scheme.parse("channel:64").bytes_per_token(64) == 36
    assert Scheme.parse("none").bytes_per_token(64) == 256
    # One-byte steps and lows halve the scales: the scheme that reaches 95% (README) costs 36
    # bytes per token and head on each side, plus its bfloat16 window and sinks per sequence.
    keys = Scheme.parse("channel:32+res+prerope+log8+z8+sink")
    values = Scheme.parse("token:32+log8+z8+sink")
    assert keys.bytes_per_token(64) == values.bytes_per_token(64) == 36
    assert keys.residual_bytes(64) == 2 * 64 * (32 + 4) and values.residual_bytes(64) == 2 * 64 * 4
    for bad in ("token", "channel:x", "rows:4", "none:3"):
        with pytest.raises(ValueError, match="want token:G"):
            Scheme.parse(bad)


def test_token_scheme_is_the_int4_format() -> None:
    """token:32 reads back what the int4 cache format reads back, up to the rounding of the
    low value (the format floors it to bfloat16, the simulation rounds it)."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, 3, 64)) * 3, jnp.float32)
    data, scales = kv_quant.quantize(hadamard_rotate(x), "int4")
    real = hadamard_rotate(kv_quant.dequantize(data, scales, "int4"), inverse=True)
    fake = fake_quantize(x, Scheme.parse("token:32"))
    step = float(jnp.max(scales[..., :2].astype(jnp.float32)))
    np.testing.assert_allclose(np.asarray(fake), np.asarray(real), atol=step)


@pytest.mark.parametrize("window", [4, 16])
def test_channel_windows_quantize_each_window_alone(window: int) -> None:
    """Per channel of each window of tokens: every value within half a step of its window's
    grid, and a window's range decides nothing outside it."""
    rng = np.random.default_rng(window)
    x = rng.standard_normal((1, 32, 2, 8)).astype(np.float32)
    x[0, :window] *= 100  # one loud window
    out = np.asarray(fake_quantize(jnp.asarray(x), Scheme("channel", window)))
    for w in range(32 // window):
        part, got = x[0, w * window:(w + 1) * window], out[0, w * window:(w + 1) * window]
        step = (part.max(0) - part.min(0)) / 15
        assert np.all(np.abs(got - part) <= step * 0.51 + 1e-2 * np.abs(part).max(0))
    quiet = np.abs(out[0, window:] - x[0, window:]).max()
    assert quiet < 0.2, "the loud window's range leaked into the next ones"


@pytest.mark.parametrize("seed", range(4))
def test_smoothing_scales_minimize_the_isotropic_score_error(seed: int) -> None:
    """+smooth's s is tied across RoPE pairs, has geometric mean 1, and minimizes
    sum(q^2 s^2) * sum(k^2 / s^2), the score error's size when the quantization error of
    k / s is isotropic with variance ~ |k / s|^2: no pair-tied perturbation of s lowers it."""
    from experiments.int4_keys import smoothing_scales

    rng = np.random.default_rng(seed)
    t, kv, group, d = 64, 3, 3, 16
    channel_scale = np.exp(rng.normal(size=d) * 1.5)  # outlier channels, as real keys have
    keys = rng.standard_normal((t, kv, d)) * channel_scale
    queries = rng.standard_normal((t, kv * group, d)) * np.exp(rng.normal(size=d))
    s = smoothing_scales(keys, queries, kv)
    assert s.shape == (kv, d)
    np.testing.assert_allclose(s[:, :d // 2], s[:, d // 2:])
    np.testing.assert_allclose(np.exp(np.log(s).mean(-1)), 1.0, rtol=1e-6)
    grouped = queries.reshape(t, kv, group, d)
    pair = lambda ms: np.tile((ms[..., :d // 2] + ms[..., d // 2:]) / 2, 2)
    ms_q = pair(np.mean(np.square(grouped), axis=(0, 2)))
    ms_k = pair(np.mean(np.square(keys), axis=0))
    error = lambda scale: np.sum(ms_q * scale ** 2, -1) * np.sum(ms_k / scale ** 2, -1)
    best = error(s)
    for _ in range(20):
        nudge = np.tile(np.exp(rng.normal(size=(kv, d // 2)) * 0.2), 2)
        assert np.all(error(s * nudge) >= best * (1 - 1e-9))
    assert np.all(best < error(np.ones_like(s)))  # and it beats no smoothing on outlier keys


def test_first_window_is_quantized_per_token_unrotated() -> None:
    """+first: positions of the first window read back as a per-token, unrotated scheme of
    groups of 32 would; every later one as the channel scheme alone."""
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 16, 2, 64)) * 2, jnp.float32)
    x = x.at[0, 0].multiply(50.0)  # a sink token
    positions = jnp.arange(16)[None]
    scheme = Scheme.parse("channel:8+log8+z8+first")
    both = np.asarray(fake_quantize(x, scheme, positions))
    token = Scheme("token", 32, step="log8", low="z8")  # rotate=False
    np.testing.assert_array_equal(both[:, :8], np.asarray(fake_quantize(x, token))[:, :8])
    channel = Scheme.parse("channel:8+log8+z8")
    np.testing.assert_array_equal(both[:, 8:], np.asarray(fake_quantize(x, channel))[:, 8:])
    with pytest.raises(ValueError, match="channel-scheme option"):
        Scheme.parse("token:32+first")


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("base", ["token:16", "channel:8+log8+z8"])
def test_smoothing_applies_before_and_after_rope(seed: int, base: str) -> None:
    """+smooth divides the keys by its per-channel scales, quantizes and multiplies back, with
    +prerope too (the scales are tied across RoPE pairs, so they commute with the rotation):
    what the cache stores is RoPE(smooth^-1 quantize(unRoPE(k) / s) * s), not +prerope alone."""
    from experiments.int4_keys import _register
    from infer.cache.metadata import AttentionMetadata
    from infer.cache.paged import PagedKVCache
    from infer.model.config import get_config
    from infer.model.llama import apply_rope, rope_frequencies

    config = get_config("tiny")
    k_heads, d, page, t = config.num_kv_heads, config.head_dim, 16, 32
    rng = np.random.default_rng(seed)
    k = jnp.asarray(rng.standard_normal((1, t, k_heads, d)) * np.exp(rng.normal(size=d) * 2),
                    jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, t, k_heads, d)), jnp.float32)
    scales = jnp.asarray(np.tile(np.exp(rng.normal(size=(k_heads, d // 2))), 2), jnp.float32)
    meta = AttentionMetadata.for_prefill(jnp.asarray([t]), t,
                                         page_tables=jnp.arange(t // page, dtype=jnp.int32)[None])
    inv_freq = jnp.asarray(rope_frequencies(config))
    fake_cache, _ = _register()

    def stored(text: str) -> np.ndarray:
        keys = Scheme.parse(text)
        cache = fake_cache(PagedKVCache.create(1, t // page, page, k_heads, d), None, (), (),
                           inv_freq, (scales,) if keys.smooth else (), keys, Scheme("none"))
        pages = np.asarray(cache.write(0, k, v, meta).inner.k[0])  # [P, K, G, D]
        return pages.transpose(0, 2, 1, 3).reshape(1, t, k_heads, d)

    for prerope in (False, True):
        scheme = base + ("+prerope" if prerope else "")
        pre = apply_rope(k, -meta.positions, inv_freq) if prerope else k
        want = fake_quantize(pre / scales, Scheme.parse(scheme), meta.positions) * scales
        want = apply_rope(want, meta.positions, inv_freq) if prerope else want
        got = stored(scheme + "+smooth")
        np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-5)
        assert not np.allclose(got, stored(scheme), rtol=1e-5, atol=1e-5), scheme


@pytest.mark.parametrize("seed", range(3))
def test_pairs_whose_groups_do_not_tile_are_refused_before_any_work(seed: int) -> None:
    """A group of 0, a token group that does not divide the head dim or a channel window that
    does not divide the chunk has no bytes per token to report: refused when the pairs are
    read, before the model is loaded and its reference scored, not by a division by zero or a
    reshape minutes in."""
    from experiments.int4_keys import CHUNK, parse_pairs

    rng = np.random.default_rng(seed)
    d = int(rng.choice([16, 64, 128]))
    for size in [0, *rng.integers(1, 300, 12)]:
        for kind, whole in (("token", d), ("channel", CHUNK)):
            text = f"{kind}:{size}/token:{min(32, d)}"
            if size >= 1 and whole % size == 0:
                (_, keys, _), = parse_pairs([text], d)
                assert keys.bytes_per_token(d) > 0
            else:
                with pytest.raises(ValueError, match="token:G|divide"):
                    parse_pairs([text], d)
