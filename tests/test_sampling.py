"""The sampler: greedy, temperature, top-k, top-p, per-row seeds, no recompiles, and the key
streams (the token stream pinned, the draft and verify streams apart from it)."""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infer.sampling import (SamplingArrays, argmax, draft_keys, draw, sample, sample_logprobs,
                            sampling_probs, token_keys, verify_keys, warp_logits)
from infer.sampling_params import MAX_LOGPROBS, SamplingParams

V = 12
LOGITS = np.log(np.array([30, 20, 12, 9, 8, 6, 5, 4, 3, 1.5, 1, 0.5], np.float32))
sample_jit = jax.jit(sample)


def _draws(params: SamplingParams, n: int = 4000, logits: np.ndarray = LOGITS) -> np.ndarray:
    """n draws for one request: the same row at steps 0..n-1."""
    arrays = SamplingArrays.from_params([params] * n)
    arrays = SamplingArrays(arrays.temperature, arrays.top_k, arrays.top_p, arrays.seeds)
    return np.asarray(sample_jit(jnp.tile(jnp.asarray(logits), (n, 1)), arrays,
                                 jnp.arange(n, dtype=jnp.int32)))


def _chi2_ok(draws: np.ndarray, probs: np.ndarray) -> bool:
    """Pearson chi-square against expected counts, at a 1e-3 false-alarm rate."""
    from scipy.stats import chi2
    support = probs > 0
    counts = np.bincount(draws, minlength=len(probs))
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {counts}"
    expected = probs[support] * len(draws)
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    return stat < chi2.ppf(1 - 1e-3, df=support.sum() - 1)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("vocab", [1, 5, MAX_LOGPROBS - 1, MAX_LOGPROBS, 3 * MAX_LOGPROBS])
def test_logprobs_of_a_vocabulary_smaller_than_max_logprobs(vocab: int) -> None:
    """The logprobs variant computes MAX_LOGPROBS alternatives: over fewer ids, top_k failed
    the whole step. Random logits: every id (or the MAX_LOGPROBS best), most likely first."""
    rng = np.random.default_rng(vocab)
    logits = jnp.asarray(rng.standard_normal((3, vocab)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, vocab, 3), jnp.int32)
    out = sample_logprobs(logits, tokens, MAX_LOGPROBS)
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    k = min(vocab, MAX_LOGPROBS)
    np.testing.assert_array_equal(np.asarray(out.top_ids), np.argsort(-logp, axis=-1)[:, :k])
    np.testing.assert_allclose(np.asarray(out.top_logprobs), -np.sort(-logp, axis=-1)[:, :k])
    np.testing.assert_allclose(np.asarray(out.logprob), logp[np.arange(3), tokens], rtol=1e-6)


def test_greedy_is_argmax_whatever_the_seed() -> None:
    draws = _draws(SamplingParams(temperature=0.0, seed=3), n=50)
    assert (draws == 0).all()


@pytest.mark.parametrize("temperature", [1e-6, 1e-30, 2e-38, 5e-324])
def test_a_tiny_temperature_is_greedy(temperature: float) -> None:
    """Logits over a tiny temperature overflow float32: inf at both large logits, of which
    the draw took the first. As vLLM, a temperature below its epsilon is greedy."""
    logits = np.array([50.0, 60.0, -1.0, 0.5] + [0.0] * (V - 4), np.float32)
    draws = _draws(SamplingParams(temperature=temperature, seed=7), n=50, logits=logits)
    assert (draws == 1).all(), draws


@pytest.mark.parametrize("temperature", [1e30, 1e39, 1e300, sys.float_info.max])
def test_a_huge_temperature_keeps_the_mask_and_top_k(temperature: float) -> None:
    """A temperature past float32's range was inf on the device: a masked logit became
    -inf / inf = NaN and the draw returned token 0 against the mask, and every logit became 0,
    so top-k kept the whole vocabulary. Random logits, masks and top-k; many steps each."""
    rng = np.random.default_rng(int(np.log10(temperature)))
    vocab, rows, steps = 96, 6, 32
    logits = jnp.asarray(rng.standard_normal((rows, vocab)) * 4, jnp.float32)
    allowed_tokens = rng.random((rows, vocab)) < 0.2
    allowed_tokens[:, 0] = False  # the token a NaN row drew
    allowed_tokens[np.arange(rows), rng.integers(1, vocab, rows)] = True
    bits = np.zeros((rows, vocab // 32), np.int64)
    for t in range(vocab):
        bits[:, t // 32] |= allowed_tokens[:, t].astype(np.int64) << (t % 32)
    allowed = bits.astype(np.uint32).view(np.int32)
    params = [SamplingParams(temperature=temperature, seed=s) for s in range(rows)]
    for step in range(steps):
        tokens = np.asarray(sample_jit(logits, SamplingArrays.from_params(params, allowed=allowed),
                                       jnp.full(rows, step, jnp.int32)))
        assert allowed_tokens[np.arange(rows), tokens].all(), (step, tokens)
    top_k = rng.integers(1, 6, rows)
    arrays = SamplingArrays.from_params([SamplingParams(temperature=temperature, top_k=int(k),
                                                        seed=0) for k in top_k])
    kept = np.isfinite(np.asarray(warp_logits(logits, arrays)))
    best = np.argsort(-np.asarray(logits), axis=-1)
    for row, k in enumerate(top_k):
        assert sorted(np.flatnonzero(kept[row])) == sorted(best[row, :k]), (row, k)


@pytest.mark.parametrize("top_k", [V, 2**31 - 1, 2**31, 2**64])
def test_a_top_k_of_the_vocabulary_or_more_restricts_nothing(top_k: int) -> None:
    """A top_k past int32 once failed the whole batch building its arrays."""
    off = _draws(SamplingParams(temperature=1.0, seed=9), n=200)
    np.testing.assert_array_equal(_draws(SamplingParams(temperature=1.0, top_k=top_k, seed=9),
                                         n=200), off)


def test_temperature_samples_softmax() -> None:
    for t in (0.7, 1.0, 1.8):
        assert _chi2_ok(_draws(SamplingParams(temperature=t, seed=1)), _softmax(LOGITS / t))


def test_top_k_renormalizes_over_the_k_best() -> None:
    probs = _softmax(LOGITS)
    probs[4:] = 0
    assert _chi2_ok(_draws(SamplingParams(temperature=1.0, top_k=4, seed=2)), probs / probs.sum())


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = _softmax(LOGITS)
    # probabilities .30, .20, .12, .09, ...: mass before each 0, .30, .50, .62 -> top_p .55 keeps 3
    keep = (np.cumsum(probs) - probs) < 0.55
    assert keep.sum() == 3
    expected = np.where(keep, probs, 0)
    assert _chi2_ok(_draws(SamplingParams(temperature=1.0, top_p=0.55, seed=4)),
                    expected / expected.sum())


def test_wrong_distribution_is_detected() -> None:
    """The chi-square check is sharp enough to reject a slightly wrong temperature."""
    assert not _chi2_ok(_draws(SamplingParams(temperature=1.0, seed=5)), _softmax(LOGITS / 1.15))


def test_top_k_and_top_p_compose() -> None:
    warped = warp_logits(jnp.asarray(LOGITS)[None],
                         SamplingArrays.from_params([SamplingParams(temperature=1.0, top_k=6,
                                                                    top_p=0.5, seed=0)]))
    # top-k 6 first (mass .85), renormalized .353, .235, .141, ...: mass before the third is
    # .588 > .5, so the nucleus holds two tokens (without top-k it would hold three)
    kept = np.isfinite(np.asarray(warped[0]))
    assert kept.tolist() == [True] * 2 + [False] * 10


def test_row_tokens_do_not_depend_on_the_batch() -> None:
    """A request's draws depend on its seed and step only: alone or beside others, the same."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((5, 300)), jnp.float32)
    params = [SamplingParams(temperature=0.9, seed=s, top_p=0.9 if s % 2 else 1.0) for s in range(5)]
    steps = jnp.asarray([7, 0, 3, 3, 100], jnp.int32)
    together = np.asarray(sample_jit(logits, SamplingArrays.from_params(params), steps))
    for row in range(5):
        alone = sample_jit(logits[row:row + 1], SamplingArrays.from_params([params[row]]),
                           steps[row:row + 1])
        assert int(alone[0]) == together[row]


def test_different_seeds_differ_and_same_seed_repeats() -> None:
    a = _draws(SamplingParams(temperature=1.0, seed=10), n=64)
    b = _draws(SamplingParams(temperature=1.0, seed=10), n=64)
    c = _draws(SamplingParams(temperature=1.0, seed=11), n=64)
    assert (a == b).all() and (a != c).any()


def test_changing_values_does_not_recompile() -> None:
    fn = jax.jit(lambda *args: sample(*args))  # a cache of its own
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((4, 50)), jnp.float32)
    steps = jnp.zeros(4, jnp.int32)
    for params in ([SamplingParams(seed=0)] * 4,
                   [SamplingParams(temperature=0.5, top_k=3, seed=9)] * 4,
                   [SamplingParams(temperature=1.2, top_p=0.3), SamplingParams(),
                    SamplingParams(top_k=2, temperature=1.0), SamplingParams(seed=4)]):
        params = [p.with_resolved_seed() for p in params]
        fn(logits, SamplingArrays.from_params(params), steps).block_until_ready()
    assert fn._cache_size() == 1


def test_unseeded_requests_draw_independent_noise() -> None:
    """seed=None is a fresh seed per request (vLLM's meaning): two unseeded requests with the
    same prompt differ. With the old default seed 0 every unseeded request drew the same noise."""
    unseeded = SamplingParams(temperature=1.0)
    assert unseeded.seed is None
    resolved = [unseeded.with_resolved_seed() for _ in range(8)]
    seeds = [p.seed for p in resolved]
    assert all(isinstance(s, int) and 0 <= s < 2**32 for s in seeds)
    assert len(set(seeds)) == len(seeds)  # 8 draws of 32 bits: a collision is a 1e-8 event
    assert all(dataclasses.replace(p, seed=None) == unseeded for p in resolved)  # only the seed
    draws = [tuple(_draws(p, n=32)) for p in resolved]
    assert len(set(draws)) == len(draws)


def test_a_resolved_seed_reproduces() -> None:
    seeded = SamplingParams(temperature=1.0, seed=123)
    assert seeded.with_resolved_seed() is seeded
    again = SamplingParams(temperature=1.0).with_resolved_seed()
    assert (_draws(again, n=64) == _draws(SamplingParams(temperature=1.0, seed=again.seed), n=64)).all()


def test_arrays_refuse_an_unresolved_seed() -> None:
    """Each step builds the arrays afresh: resolving there would give a request new noise at
    every step, so the arrays insist that the caller resolved the seed once, at the request."""
    with pytest.raises(ValueError, match=r"rows \[1\] have seed=None.*with_resolved_seed"):
        SamplingArrays.from_params([SamplingParams(seed=1), SamplingParams(temperature=0.5)])
    padded = SamplingArrays.from_params([SamplingParams(seed=7)], batch=3)  # padding is seeded
    assert np.asarray(padded.seeds).tolist() == [7, 0, 0]


PINNED_ROWS = [29, 39, 16, 16, 4, 29]
PINNED_STREAM = [37, 27, 6, 7, 11, 32, 37, 22, 23, 31, 2, 3, 39, 24, 33, 33]


def test_the_token_stream_is_pinned() -> None:
    """Seeded outputs of plain sampling are reproducible across versions of infer: these draws
    pin the key rule (fold_in(key(seed), sample_index)) and the draw (one uniform per row
    against the running sum of the warped distribution, `inverse_cdf_draw`, which replaced a
    Gumbel-max categorical: the values below changed then). A change here changes every seeded
    output."""
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((6, 40)), jnp.float32)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=s) for t, k, p, s in
              [(1.0, 0, 1.0, 1), (0.7, 5, 1.0, 2), (1.3, 0, 0.8, 3), (0.0, 0, 1.0, 4),
               (1.0, 3, 0.9, 2**32 - 1), (2.0, 0, 1.0, 0)]]
    index = jnp.asarray([0, 1, 7, 3, 100, 12345], jnp.int32)
    got = sample_jit(logits, SamplingArrays.from_params(params), index)
    assert np.asarray(got).tolist() == PINNED_ROWS
    row = SamplingArrays.from_params([SamplingParams(temperature=1.0, seed=7)] * 16)
    got = sample_jit(jnp.tile(logits[:1], (16, 1)), row, jnp.arange(16, dtype=jnp.int32))
    assert np.asarray(got).tolist() == PINNED_STREAM


def test_inverse_cdf_draw_over_a_whole_vocabulary() -> None:
    """SmolLM2's vocabulary size, a third of the ids impossible (-inf): the draws follow the
    softmax (chi-square over the 40 likeliest ids and one bin for the rest, whose 49k small
    running-sum steps are where float rounding would show) and never land on an impossible
    id."""
    from infer.sampling import inverse_cdf_draw

    rng = np.random.default_rng(3)
    vocab, rows, rounds = 49152, 1000, 12
    logits = (2.5 * rng.standard_normal(vocab)).astype(np.float32)
    logits[rng.random(vocab) < 1 / 3] = -np.inf
    probs = _softmax(logits)
    # The suite compiles at LLVM's O0 (conftest), where this program's 49M-element running
    # sums run ten times slower than optimized (3.6 against 0.36 s a round).
    draw_rows = jax.jit(lambda keys, x: inverse_cdf_draw(keys, jnp.tile(x[None], (rows, 1))),
                        compiler_options={"xla_backend_optimization_level": 3})
    draws = np.concatenate([np.asarray(draw_rows(token_keys(
        jnp.full(rows, r, jnp.uint32), jnp.arange(rows, dtype=jnp.int32)), jnp.asarray(logits)))
        for r in range(rounds)])
    assert np.isfinite(logits[draws]).all()
    top = np.argsort(-probs)[:40]
    binned = np.where(np.isin(draws, top), np.searchsorted(np.sort(top), draws), 40)
    binned_probs = np.append(probs[np.sort(top)], 1 - probs[top].sum())
    assert _chi2_ok(binned, binned_probs)


@pytest.mark.parametrize("seed", range(4))
def test_inverse_cdf_pick_is_a_search_of_the_running_sum(seed: int) -> None:
    """Against numpy's searchsorted over the running sum, for batched and unbatched weights with
    zero-weight ids (leading, trailing, inside): the first id whose running sum exceeds u *
    total, never a zero-weight one, u = 0 included."""
    from infer.sampling import inverse_cdf_pick

    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(2, 300))
    weights = rng.random((7, vocab)).astype(np.float32) * rng.random((7, 1)) * 10
    weights[rng.random((7, vocab)) < 0.4] = 0
    weights[:, 0] = 0 if seed % 2 else weights[:, 0]
    weights[:, -1] = 0 if seed % 2 == 0 else weights[:, -1]
    weights[np.arange(7), rng.integers(0, vocab, 7)] = 1.0  # every row can draw something
    u = rng.random(7).astype(np.float32)
    u[0] = 0.0
    got = np.asarray(jax.jit(inverse_cdf_pick)(jnp.asarray(u), jnp.asarray(weights)))
    running = np.cumsum(weights.astype(np.float64), axis=-1)
    want = [np.searchsorted(r, ui * r[-1], side="right") for r, ui in zip(running, u)]
    assert got.tolist() == want
    assert (weights[np.arange(7), got] > 0).all()
    single = [int(jax.jit(inverse_cdf_pick)(u[i], jnp.asarray(weights[i]))) for i in range(7)]
    assert single == want


def test_the_key_streams_never_meet() -> None:
    """Over many seeds and indices, no token key is a verify or draft key and no two drafts of
    a step share one: a shared key would correlate a verifier's accept test with the draw it
    judges, or two drafts with each other."""
    seeds = jnp.asarray(np.repeat(np.arange(8, dtype=np.uint32), 32))
    index = jnp.asarray(np.tile(np.arange(32, dtype=np.int32), 8))
    data = lambda keys: {tuple(k) for k in np.asarray(jax.random.key_data(keys)).tolist()}
    streams = [data(token_keys(seeds, index)), data(verify_keys(seeds, index))]
    streams += [data(draft_keys(seeds, index, j)) for j in range(4)]
    assert all(len(s) == len(seeds) for s in streams)  # distinct within each stream
    assert len(set().union(*streams)) == sum(map(len, streams))  # and across streams
    # The token stream is the documented rule itself.
    want = jax.random.fold_in(jax.random.key(5), 9)
    assert (jax.random.key_data(token_keys(jnp.asarray([5], jnp.uint32),
                                           jnp.asarray([9])))[0]
            == jax.random.key_data(want)).all()


def test_draw_is_sample_and_gives_the_warped_distribution() -> None:
    """The one draw: with the token keys it is `sample`; with_probs adds each row's warped
    distribution (a proposer's q), and greedy rows stay the argmax either way."""
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.standard_normal((4, 30)), jnp.float32)
    params = [SamplingParams(temperature=0.8, top_k=4, seed=1), SamplingParams(seed=2),
              SamplingParams(temperature=1.5, top_p=0.6, seed=3),
              SamplingParams(temperature=1.0, seed=4)]
    arrays, index = SamplingArrays.from_params(params), jnp.asarray([0, 5, 2, 9], jnp.int32)
    keys = token_keys(arrays.seeds, index)
    tokens, probs = jax.jit(draw, static_argnums=3)(logits, arrays, keys, True)
    assert probs is not None
    np.testing.assert_array_equal(tokens, sample_jit(logits, arrays, index))
    np.testing.assert_allclose(probs, jax.nn.softmax(warp_logits(logits, arrays), -1), rtol=1e-6)
    np.testing.assert_allclose(sampling_probs(logits[:, None].repeat(3, 1), arrays)[:, 2], probs,
                               rtol=1e-6)
    assert int(tokens[1]) == int(jnp.argmax(logits[1]))
    assert (np.asarray(probs[0]) > 0).sum() == 4  # top-k 4
    assert draw(logits, arrays, keys)[1] is None


def test_argmax_is_jnp_argmax_on_ties_nans_and_infinities() -> None:
    """The CPU formulation (a max, then its first index) returns jnp.argmax's index for every
    row: random logits, rows of few distinct values (ties: the first), rows with NaNs (the first
    NaN), all -inf, signed zeros, over random shapes (a decode step's [B, V], a verify step's
    [B, k+1, V], a tree node's [V])."""
    rng = np.random.default_rng(0)
    fn = jax.jit(argmax)
    for trial in range(40):
        shape = tuple(rng.integers(1, 6, rng.integers(0, 3))) + (int(rng.integers(1, 300)),)
        kind = trial % 5
        if kind == 0:
            x = rng.standard_normal(shape).astype(np.float32)
        elif kind == 1:
            x = rng.integers(0, 3, shape).astype(np.float32)
        elif kind == 2:
            x = rng.standard_normal(shape).astype(np.float32)
            x[rng.random(shape) < 0.05] = np.nan
        elif kind == 3:
            x = np.where(rng.random(shape) < 0.5, -np.inf, np.inf).astype(np.float32)
            x[..., : shape[-1] // 2] = -np.inf
        else:
            x = np.where(rng.random(shape) < 0.5, -0.0, 0.0).astype(np.float32)
        got = np.asarray(fn(jnp.asarray(x)))
        assert got.dtype == np.int32 and got.shape == shape[:-1]
        np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    row = jnp.full((1, 7), -jnp.inf)
    assert int(fn(row)[0]) == 0


def _warp_reference(x: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """vLLM's order over one row: top-k by value (ties with the k-th kept), then the nucleus of
    what is left (a token kept while the mass ranked above it is below top_p; ties with the
    last kept token kept)."""
    kept = np.isfinite(x)
    if top_k:
        kept &= x >= np.sort(x)[::-1][min(top_k, len(x)) - 1]
    probs = np.where(kept, np.exp(x - x.max()), 0)
    probs /= probs.sum()
    order = np.argsort(-x, kind="stable")
    before = np.cumsum(probs[order]) - probs[order]
    if top_p >= 1:
        return kept
    nucleus = ((before < top_p) | (np.arange(len(x)) == 0)) & kept[order]
    return kept & (x >= x[order][nucleus].min())


def test_top_k_and_top_p_keep_the_reference_set_with_ties() -> None:
    """Logits on a coarse grid tie often (bfloat16 logits do): top-k keeps every token tied with
    the k-th, and top-p's nucleus is measured over all of them."""
    rng = np.random.default_rng()
    rows, params = [], []
    for _ in range(64):
        rows.append(rng.integers(0, 5, V).astype(np.float32) * 0.5)
        params.append(SamplingParams(temperature=1.0, top_k=int(rng.integers(0, V + 2)),
                                     top_p=float(rng.choice([1.0, rng.uniform(0.05, 1.0)])),
                                     seed=0))
    warped = np.asarray(warp_logits(jnp.asarray(np.stack(rows)),
                                    SamplingArrays.from_params(params)))
    for x, p, w in zip(rows, params, warped):
        np.testing.assert_array_equal(np.isfinite(w), _warp_reference(x, p.top_k, p.top_p),
                                      err_msg=f"{x}, top_k {p.top_k}, top_p {p.top_p}")


def test_logprob_rank_counts_ties_as_vllm() -> None:
    """rank = how many tokens are at least as likely as the chosen one (vLLM's count): a token
    tied with others ranks after all of them, whichever index the sampler took."""
    rng = np.random.default_rng()
    logits = rng.integers(0, 4, (16, 20)).astype(np.float32)
    tokens = rng.integers(0, 20, 16)
    got = sample_logprobs(jnp.asarray(logits), jnp.asarray(tokens, jnp.int32), 3)
    expected = [(row >= row[t]).sum() for row, t in zip(logits, tokens)]
    np.testing.assert_array_equal(got.rank, expected)
