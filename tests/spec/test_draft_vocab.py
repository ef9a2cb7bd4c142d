"""A reduced draft vocabulary (FR-Spec): model proposers score only the top N ids of a ranking,
map their choices back to target ids, and leave outputs exact; with N = V in id order they draft
exactly what the full vocabulary drafts. On the tiny model, random draft weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.draft_vocab import coverage, rank_ids
from infer.engine.engine import Engine, EngineConfig
from infer.model.config import get_config
from infer.sampling import SamplingArrays
from infer.sampling_params import SamplingParams
from infer.spec.config import SpeculativeConfig
from infer.spec.draft_vocab import load_draft_vocab
from infer.spec.model_proposers import _draw_draft
from infer.spec.ngram import NgramProposer
from tests.spec.proposals import record_proposals

TINY = get_config("tiny")
V = TINY.vocab_size
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=12, temperature=0.9, top_k=40, seed=3, ignore_eos=True)
# The draft model's proposer is also the self-draft's; the self-draft runs with a reduced
# vocabulary in tests/spec/test_speculative_sampling_engine.py.
MODEL_METHODS = ("draft", "eagle")


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(1, V, rng.integers(3, 20)).tolist() for _ in range(3)] + [[5, 6, 7] * 4]


def spec(method: str, weights: dict[str, str], **fields) -> SpeculativeConfig:
    return SpeculativeConfig(method, 3, self_draft_layers=1, draft_path=weights["draft"],
                             eagle_path=weights["eagle"], **fields)


def save_ranking(path, ids) -> str:
    np.save(path, np.asarray(ids, np.int32))
    return str(path)


def run(model, spec_config: SpeculativeConfig | None, params: SamplingParams):
    """Outputs of `prompts()` through a small engine, and each propose call's drafts [rows, k],
    counts and draft probabilities (None for greedy batches) as host arrays."""
    engine = Engine(model, None, EngineConfig(max_num_seqs=2, max_prefill_tokens=16,
                                              max_model_len=64, page_size=4,
                                              speculative=spec_config))
    recorded = record_proposals(engine) if spec_config is not None else []
    ids = [engine.add_request(prompt_token_ids=p, params=params) for p in prompts()]
    engine.run_until_done()
    calls = [(c.drafts, c.counts, c.probs) for c in recorded]
    return [engine.output(i).token_ids for i in ids], calls


@pytest.fixture(scope="module")
def plain(tiny_model) -> dict[str, list[list[int]]]:
    return {"greedy": run(tiny_model, None, GREEDY)[0]}


@pytest.fixture(scope="module")
def full_vocab(tiny_model, tiny_weights):
    """run() of each method without a reduction, greedy and sampled, made when first asked."""
    runs = {}

    def get(method: str, params: SamplingParams):
        key = method, params.greedy
        if key not in runs:
            runs[key] = run(tiny_model, spec(method, tiny_weights), params)
        return runs[key]
    return get


@pytest.fixture(scope="module")
def ranking(plain, tmp_path_factory) -> np.ndarray:
    """The tiny target's ids ranked by its own greedy generations, as experiments.draft_vocab
    ranks SmolLM2's: the ids it generated first."""
    counts = np.bincount(np.concatenate(plain["greedy"]), minlength=V)
    return rank_ids(counts, np.zeros(V, np.int64))


@pytest.mark.parametrize("method", MODEL_METHODS)
def test_reduced_vocab_keeps_outputs_and_drafts_inside_it(tiny_model, tiny_weights, plain,
                                                          ranking, tmp_path, method) -> None:
    """Greedy outputs equal plain decoding's; every draft, greedy or sampled, is one of the N
    ids, and a sampled draft's q is a distribution over them, zero elsewhere."""
    n = 24
    path = save_ranking(tmp_path / "ranking.npy", ranking)
    config = spec(method, tiny_weights, draft_vocab_size=n, draft_vocab_path=path)
    subset = set(ranking[:n].tolist())
    for name, params in (("greedy", GREEDY), ("sampled", SAMPLED)):
        out, calls = run(tiny_model, config, params)
        if name == "greedy":
            assert out == plain["greedy"], method
        assert sum(int(c.sum()) for _, c, _ in calls) > 0
        for drafts, counts, probs in calls:
            for row, count in enumerate(counts):
                assert set(drafts[row, :count].tolist()) <= subset, (method, name)
                if probs is not None and count:
                    outside = np.delete(probs[row, :count], ranking[:n], axis=-1)
                    assert not outside.any(), (method, name)
                    np.testing.assert_allclose(probs[row, :count].sum(-1), 1.0, rtol=1e-5)
        assert (name == "sampled") == any(p is not None for *_, p in calls)


@pytest.mark.parametrize("method", MODEL_METHODS)
def test_full_size_in_id_order_drafts_as_the_full_vocabulary(tiny_model, tiny_weights,
                                                             full_vocab, tmp_path, method
                                                             ) -> None:
    """N = V with the identity table: the same drafts and the same q as without a reduction."""
    path = save_ranking(tmp_path / "identity.npy", np.arange(V))
    same = spec(method, tiny_weights, draft_vocab_size=V, draft_vocab_path=path)
    for params in (GREEDY, SAMPLED):
        (out_a, calls_a), (out_b, calls_b) = full_vocab(method, params), run(tiny_model, same,
                                                                             params)
        assert out_a == out_b and len(calls_a) == len(calls_b)
        for (d_a, c_a, p_a), (d_b, c_b, p_b) in zip(calls_a, calls_b):
            np.testing.assert_array_equal(d_a, d_b)
            np.testing.assert_array_equal(c_a, c_b)
            assert (p_a is None) == (p_b is None)
            if p_a is not None:
                np.testing.assert_array_equal(p_a, p_b)


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_a_subset_holding_every_full_draft_drafts_the_same(tiny_model, tiny_weights,
                                                           full_vocab, tmp_path, method) -> None:
    """A subset that holds every id the full vocabulary drafted, in shuffled order (so a
    subset index is not its id): greedy argmaxes over it are the same ids, so the drafts are
    the full run's exactly (a wrong map back would change them)."""
    out, calls = full_vocab(method, GREEDY)
    drafted = np.unique(np.concatenate([d[r, :c] for d, cs, _ in calls
                                        for r, c in enumerate(cs)]))
    assert len(drafted) < V // 2
    rng = np.random.default_rng(1)
    order = np.concatenate([rng.permutation(drafted),
                            rng.permutation(np.setdiff1d(np.arange(V), drafted))])
    path = save_ranking(tmp_path / "drafted.npy", order)
    reduced = spec(method, tiny_weights, draft_vocab_size=len(drafted), draft_vocab_path=path)
    out_r, calls_r = run(tiny_model, reduced, GREEDY)
    assert out_r == out and len(calls_r) == len(calls)
    for (d_a, c_a, _), (d_b, c_b, _) in zip(calls, calls_r):
        np.testing.assert_array_equal(c_a, c_b)
        for row, count in enumerate(c_a):
            np.testing.assert_array_equal(d_a[row, :count], d_b[row, :count])


def test_draw_subset_is_the_draw_over_those_ids(tiny_model) -> None:
    """Greedy: the argmax of the full logits among the subset; sampled: q is the row's warped
    softmax over the subset's logits, placed at their ids (over the model's vocabulary)."""
    rng = np.random.default_rng(0)
    e, n = 8, 5
    head = jnp.asarray(rng.normal(size=(V, e)), jnp.float32)
    hidden = jnp.asarray(rng.normal(size=(3, e)), jnp.float32)
    ids = jnp.asarray(rng.choice(V, n, replace=False), jnp.int32)
    params = [SamplingParams(seed=0), SamplingParams(temperature=0.8, seed=1),
              SamplingParams(temperature=1.3, top_k=3, seed=2)]
    sampling = SamplingArrays.from_params(params)
    keys = jax.random.split(jax.random.key(0), 3)
    tokens, probs, sure = _draw_draft(tiny_model, hidden, (head[ids], ids), sampling, keys, True)
    full = np.asarray(hidden @ head.T)
    sub = full[:, np.asarray(ids)]
    # Confidence: the top probability of what the row draws from, over the subset: the plain
    # softmax for the greedy row, q for the sampled ones.
    own = np.exp(sub[0] - sub[0].max())
    np.testing.assert_allclose(float(sure[0]), 1 / own.sum(), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(sure)[1:], np.asarray(probs)[1:].max(1), rtol=1e-6)
    assert int(tokens[0]) == int(ids[np.argmax(sub[0])])
    assert set(np.asarray(tokens).tolist()) <= set(np.asarray(ids).tolist())
    want = jax.nn.softmax(jnp.asarray(sub[1]) / 0.8)
    np.testing.assert_allclose(np.asarray(probs)[1, np.asarray(ids)], want, rtol=1e-5)
    assert np.count_nonzero(np.asarray(probs)[2]) == 3  # top-k among the subset
    np.testing.assert_array_equal(np.delete(np.asarray(probs), np.asarray(ids), axis=1), 0)
    greedy_only, none, _ = _draw_draft(tiny_model, hidden, (head[ids], ids), sampling, keys,
                                       False)
    assert none is None and int(greedy_only[0]) == int(tokens[0])


def test_config_refuses_what_it_cannot_use(tmp_path, tiny_model, tiny_weights) -> None:
    path = save_ranking(tmp_path / "ranking.npy", np.arange(V)[::-1])
    with pytest.raises(ValueError, match="ngram"):
        SpeculativeConfig("ngram", 2, draft_vocab_size=8, draft_vocab_path=path)
    for bad in (0, -3, True, 2.5, "8"):
        with pytest.raises(ValueError, match="positive int"):
            spec("eagle", tiny_weights, draft_vocab_size=bad, draft_vocab_path=path)
    with pytest.raises(FileNotFoundError, match="experiments.draft_vocab"):
        spec("draft", tiny_weights, draft_vocab_size=8, draft_vocab_path=str(tmp_path / "none"))
    spec("draft", tiny_weights, draft_vocab_path=str(tmp_path / "none"))  # unused: not read
    with pytest.raises(ValueError, match="3 children per node"):  # top-k of 3 from 2 ids
        spec("eagle", tiny_weights, tree="3x2", draft_vocab_size=2, draft_vocab_path=path)
    spec("eagle", tiny_weights, tree="3x2", draft_vocab_size=3, draft_vocab_path=path)
    for low, high in ((0, 2), (3, 2), (-1, 4), (1.0, 3), (1, True)):
        with pytest.raises(ValueError, match="ngram_m"):
            SpeculativeConfig("ngram", 2, ngram_min=low, ngram_max=high)
    for low, high in ((0, 2), (3, 2), (-1, 4)):
        with pytest.raises(ValueError, match="min_n"):
            NgramProposer(high, low)
    # The bound is the target's vocabulary, checked when the proposer is built.
    too_big = spec("self_draft", tiny_weights, draft_vocab_size=V + 1, draft_vocab_path=path)
    with pytest.raises(ValueError, match=rf"\[1, {V}\]"):
        Engine(tiny_model, None, EngineConfig(max_num_seqs=1, max_model_len=32, page_size=4,
                                              speculative=too_big))
    assert load_draft_vocab(path, V, V).tolist() == list(range(V))[::-1]
    for name, ids, match in (("dup", [3, 3, 4], "distinct"), ("range", [1, 2, V], "distinct"),
                             ("short", [1, 2], "ranks 2 ids"),
                             ("float", np.arange(4.0), "integer")):
        bad = str(tmp_path / f"{name}.npy")
        np.save(bad, np.asarray(ids))
        with pytest.raises(ValueError, match=match):
            load_draft_vocab(bad, 3, V)


def test_ranking_and_coverage() -> None:
    counts = np.array([0, 5, 2, 5, 0, 1])
    fallback = np.array([9, 0, 0, 1, 3, 0])
    ranking = rank_ids(counts, fallback)
    # 5s: id 3 (fallback 1) before id 1; then 2, 5; unseen ids by fallback: 0 (9), 4 (3).
    assert ranking.tolist() == [3, 1, 2, 5, 0, 4] and ranking.dtype == np.int32
    assert coverage(ranking, [3, 3, 1, 0], [1, 2, 6]) == {1: 0.5, 2: 0.75, 6: 1.0}
