"""The confidence stop of model drafts (`SpeculativeConfig.draft_confidence`): a row's chain
ends before its first draft whose running product of confidences falls below the threshold, a
feed no row wants does not run, and outputs stay exactly plain decoding's. (The sampled law
with the stop is in tests/spec/test_speculative_sampling_engine.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infer.cache.contiguous import KVCache
from infer.cache.metadata import AttentionMetadata
from infer.engine.engine import Engine, EngineConfig
from infer.model.config import get_config
from infer.sampling_params import SamplingParams
from infer.spec.config import SpeculativeConfig
from infer.spec.draft_model import load_draft
from infer.sampling import SamplingArrays
from infer.spec.model_proposers import _draft_chain, _draw_draft
from tests.spec.proposals import record_proposals

TINY = get_config("tiny")
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
B, K = 4, 5


def reference_counts(confidence: np.ndarray, limits: np.ndarray, threshold: float) -> np.ndarray:
    """Per row: drafts j < limit taken while the product of confidences 0..j stays >= it."""
    counts = np.zeros(len(limits), np.int32)
    for row, limit in enumerate(limits):
        product = 1.0
        for j in range(limit):
            product *= float(confidence[row, j])
            if product < threshold:
                break
            counts[row] += 1
    return counts


@pytest.mark.parametrize("threshold", [None, 0.2, 0.5, 0.8, 1.0])
def test_chain_stops_and_skips_unwanted_feeds(threshold) -> None:
    """Random confidences and limits: counts follow the rule (a product equal to the threshold
    passes), each row's feeds are its drafts but the last (and none past its stop), and a feed
    runs only when some row writes."""

    @jax.jit
    def chain(confidence, limits):
        def draw_from(state, j):
            return jnp.full((B,), j, jnp.int32), None, confidence[:, j]

        def feed(state, token, j, write, cache):
            # The "cache" counts the feeds that ran and each row's writes.
            runs, writes = cache
            return state, (runs + 1, writes + write)

        return _draft_chain(draw_from, feed, jnp.zeros((B, 2)),
                            (jnp.zeros((), jnp.int32), jnp.zeros(B, jnp.int32)), limits, K,
                            threshold)

    rng = np.random.default_rng(0)
    for _ in range(60):
        # Confidences are products of probabilities: mostly high, sometimes low.
        confidence = rng.choice([rng.uniform(0.05, 0.6), 1.0], size=(B, K), p=[0.3, 0.7]) \
            * rng.uniform(0.7, 1.0, size=(B, K))
        # Some drafts certain to float32's precision: at threshold 1 they still pass.
        confidence = np.where(rng.random((B, K)) < 0.4, 1.0, confidence)
        limits = rng.integers(0, K + 1, B).astype(np.int32)
        drafts, q, counts, (runs, row_writes) = chain(jnp.asarray(confidence, jnp.float32), jnp.asarray(limits))
        want = limits if threshold is None else reference_counts(confidence.astype(np.float32),
                                                                 limits, threshold)
        np.testing.assert_array_equal(np.asarray(counts), want)
        assert q is None
        np.testing.assert_array_equal(np.asarray(drafts), np.tile(np.arange(K), (B, 1)))
        # Row r writes draft j + 1 iff it wants draft j + 2 and has not stopped at draft j.
        writes = np.array([[j + 1 < limits[r] and j < want[r] for j in range(K - 1)]
                           for r in range(B)])
        np.testing.assert_array_equal(np.asarray(row_writes), writes.sum(1))
        # The proposer's bookkeeping of fed drafts.
        np.testing.assert_array_equal(np.asarray(row_writes),
                                      np.maximum(np.minimum(limits - 1, want), 0))
        assert int(runs) == (writes.any(0).sum() if threshold is not None else K - 1)


def test_confidence_is_known_before_the_draw(tiny_model) -> None:
    """A sampled row's confidence is the top of its q, not the drawn token's q: drawing a token
    and then keeping it only if it was likely would keep a law other than q. (Many rows, so
    that some draw a token below their top and the two rules differ.)"""
    rng = np.random.default_rng(0)
    rows = 64
    hidden = jnp.asarray(rng.normal(size=(rows, TINY.hidden_size)) * 0.05, jnp.float32)
    params = [SamplingParams(temperature=1.5, top_k=8, seed=i) for i in range(rows - 1)]
    sampling = SamplingArrays.from_params(params + [SamplingParams(seed=0)])  # the last greedy
    keys = jax.random.split(jax.random.key(1), rows)
    tokens, q, sure = _draw_draft(tiny_model, hidden, None, sampling, keys, True)
    tokens, q, sure = np.asarray(tokens), np.asarray(q), np.asarray(sure)
    drawn = q[np.arange(rows), tokens]
    assert (drawn[:-1] < q[:-1].max(1) - 1e-3).sum() >= 5
    np.testing.assert_allclose(sure[:-1], q[:-1].max(1), rtol=1e-6)
    logits = np.asarray(tiny_model.logits(hidden[-1:]))[0].astype(np.float64)
    np.testing.assert_allclose(sure[-1], 1 / np.exp(logits - logits.max()).sum(), rtol=1e-5)


def serve(model, spec: SpeculativeConfig | None, prompts: list[list[int]]):
    """Greedy outputs of `prompts`, every propose call (`Proposal`) and the speculation stats."""
    engine = Engine(model, None, EngineConfig(max_num_seqs=3, max_prefill_tokens=16,
                                              max_model_len=64, page_size=4, speculative=spec))
    calls = record_proposals(engine) if spec is not None else []
    ids = [engine.add_request(prompt_token_ids=p, params=GREEDY) for p in prompts]
    engine.run_until_done()
    return [engine.output(i).token_ids for i in ids], calls, engine.speculative_stats()


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(1, TINY.vocab_size, rng.integers(3, 20)).tolist() for _ in range(4)]


@pytest.fixture(scope="module")
def plain(tiny_model) -> list[list[int]]:
    return serve(tiny_model, None, prompts())[0]


def test_draft_model_counts_follow_its_own_probabilities(tiny_model, tiny_weights, plain) -> None:
    """Each call's counts against the draft model's probabilities from a dense forward over
    the row's tokens and drafts, at thresholds either side of the median confidence (so the
    stop both ends chains and lets them run); greedy outputs stay plain decoding's."""
    draft = load_draft(tiny_model, tiny_weights["draft"])
    length = 64

    @jax.jit
    def next_probs(tokens: jax.Array, n: jax.Array) -> jax.Array:
        cache = KVCache.create(draft.config.num_layers, 1, length, draft.config.num_kv_heads,
                               draft.config.head_dim)
        logits, _, _ = draft(tokens[None], cache, AttentionMetadata.for_prefill(n[None], length))
        return jax.nn.softmax(logits[0, n - 1])

    def confidences(calls):
        """[rows, k] probability of each draft, and whether it is the draft model's argmax."""
        out = []
        for call in calls:
            table = np.ones((len(call.tokens), call.drafts.shape[1]))
            for row, seq in enumerate(call.tokens):
                for j in range(call.limits[row]):
                    ids = seq + call.drafts[row, :j].tolist()
                    padded = np.zeros(length, np.int32)
                    padded[:len(ids)] = ids
                    p = np.asarray(next_probs(jnp.asarray(padded), jnp.asarray(len(ids))))
                    assert int(np.argmax(p)) == call.drafts[row, j]  # greedy: the argmax
                    table[row, j] = p.max()
            out.append(table)
        return out

    base = SpeculativeConfig("draft", 3, draft_path=tiny_weights["draft"])
    _, calls, _ = serve(tiny_model, base, prompts())
    tables = confidences(calls)
    second = np.median([t[r, :2].prod() for t, call in zip(tables, calls)
                        for r in range(len(call.limits)) if call.limits[r] >= 2])
    stopped = []
    for threshold in (0.5 * second, second, min(1.0, 1.5 * second)):
        spec = SpeculativeConfig("draft", 3, draft_path=tiny_weights["draft"],
                                 draft_confidence=float(threshold))
        out, calls, _ = serve(tiny_model, spec, prompts())
        assert out == plain
        stopped.append(0)
        for call, table in zip(calls, confidences(calls)):
            want = reference_counts(table, np.array(call.limits), threshold)
            products = np.cumprod(table, axis=1)
            # Float noise between the paged and the dense forward decides nothing here.
            if np.abs(products - threshold).min() > 1e-5:
                np.testing.assert_array_equal(call.counts, want)
            stopped[-1] += int((call.counts < np.array(call.limits)).sum())
    assert stopped[1] > 0 and stopped[2] > 0, stopped


def test_eagle_outputs_stay_plain_and_a_sure_nothing_drafts_nothing(tiny_model, tiny_weights,
                                                                    plain) -> None:
    """Greedy outputs equal plain decoding's with the EAGLE head too (the draft model's are
    checked above). At 1 the random head is never sure enough (its top probabilities are far
    below 1), so nothing is proposed and every step is a plain one. (The tiny draft model is
    often certain to float32's precision, a top probability of exactly 1, and drafts then.)"""
    for threshold in (0.3, 1.0):
        spec = SpeculativeConfig("eagle", 3, draft_confidence=threshold,
                                 eagle_path=tiny_weights["eagle"])
        out, calls, stats = serve(tiny_model, spec, prompts())
        assert out == plain, threshold
        assert calls and all((c.counts <= np.array(c.limits)).all() for c in calls)
        assert (stats["proposed"] == 0) == (threshold == 1.0), stats


def test_config_checks_the_threshold(tiny_weights) -> None:
    paths = dict(draft_path=tiny_weights["draft"], eagle_path=tiny_weights["eagle"])
    for bad in (0, -0.1, 1.5, True, "0.5", float("nan")):
        with pytest.raises(ValueError, match=r"draft_confidence must be a number in \(0, 1\]"):
            SpeculativeConfig("eagle", 2, draft_confidence=bad, **paths)
    with pytest.raises(ValueError, match="ngram"):
        SpeculativeConfig("ngram", 2, draft_confidence=0.5)
    assert SpeculativeConfig("draft", 2, draft_confidence=np.float32(0.5), **paths)
