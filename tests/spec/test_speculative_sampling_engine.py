"""Sampled speculative decoding in the serving engine keeps the target's distribution.

tests/spec/test_verify.py checks the verification rules on their own; here the whole engine runs
(proposer, scheduler, runner, verify step, rollback), and the joint law of each request's first
three tokens is compared, by a chi-square test, with the exact law of plain sampling, computed
from the target's logits with the sampler's own warp (temperature, top-k, top-p). Three tokens,
not two: the first comes from the prefill step and is never speculated, so the second and third
are the first verify step's two draft positions. A deliberately wrong acceptance rule, patched
into the engine's verify step, must fail the same test.

The tiny random model mostly copies its last token (tied embeddings), so the prompt is built for
n-gram lookup: after a first token 6, the suffix `3 6 6` occurred earlier, followed by `6 6`,
so the proposer drafts two tokens that the target accepts about 60% of the time each.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import infer.spec.verify
from infer.cache.contiguous import KVCache
from infer.cache.metadata import AttentionMetadata
from infer.engine.engine import Engine, EngineConfig
from infer.model.config import get_config
from infer.model.llama import Llama
from infer.sampling import SamplingArrays, warp_logits
from infer.sampling_params import SamplingParams
from infer.spec.config import SpeculativeConfig
from infer.spec.verify import verify_sampled

TINY = get_config("tiny")
PROMPT = [3, 6, 6, 6, 6, 6, 6, 4, 3, 6]
# Temperature 9 spreads the copy token's mass (logit gaps ~15 at temperature 1); top-k 4 and
# top-p 0.9 then leave 24 joint outcomes for three tokens, top-p trimming some positions to 3.
# max_tokens 4: a request with one token out may draft max_tokens - 2 = 2 more.
SAMPLING = dict(temperature=9.0, top_k=4, top_p=0.9, max_tokens=4, ignore_eos=True)
NUM_TOKENS = 3
NUM_REQUESTS = 400
# The self-draft's top probability here is mostly 1 (top-p leaves one token) and below 0.97
# at the positions where the first draft is a real choice: the stop ends those chains.
CONFIDENCE_STOP = 0.97
SPECS = {"ngram": SpeculativeConfig("ngram", 2), "suffix": SpeculativeConfig("suffix", 2),
         "self_draft": SpeculativeConfig("self_draft", 2, self_draft_layers=1)}


@pytest.fixture(scope="module")
def exact_law(tiny_model) -> dict[tuple[int, ...], float]:
    return exact_joint(tiny_model, PROMPT, SamplingParams(seed=0, **SAMPLING), NUM_TOKENS)


def exact_joint(model: Llama, prompt: list[int], params: SamplingParams, depth: int
                ) -> dict[tuple[int, ...], float]:
    """P(first `depth` tokens) of plain sampling, one dense forward per prefix in the support."""
    rows = params.top_k ** (depth - 1)  # the most prefixes a level can have
    length = len(prompt) + depth - 1

    @jax.jit  # one shape for every level: eagerly, each op compiles anew per shape (~15 s here)
    def next_token_probs(tokens: jax.Array, lens: jax.Array) -> tuple[jax.Array, jax.Array]:
        cache = KVCache.create(TINY.num_layers, rows, length, TINY.num_kv_heads, TINY.head_dim)
        logits, _, _ = model(tokens, cache, AttentionMetadata.for_prefill(lens, length))
        logits = logits[jnp.arange(rows), lens - 1]
        sampling = SamplingArrays.from_params([params] * rows)
        return jax.nn.softmax(warp_logits(logits, sampling), axis=-1), logits

    law = {(): 1.0}
    for _ in range(depth):
        prefixes = list(law)
        tokens = np.zeros((rows, length), np.int32)
        lens = np.ones(rows, np.int32)
        for i, p in enumerate(prefixes):
            seq = prompt + list(p)
            tokens[i, :len(seq)], lens[i] = seq, len(seq)
        probs, logits = next_token_probs(jnp.asarray(tokens), jnp.asarray(lens))
        probs, logits = np.asarray(probs, np.float64), np.asarray(logits)[:len(prefixes)]
        assert_top_p_not_borderline(logits, params)
        law = {p + (int(t),): law[p] * probs[i, t]
               for i, p in enumerate(prefixes) for t in np.flatnonzero(probs[i])}
    return law


def assert_top_p_not_borderline(logits: np.ndarray, params: SamplingParams) -> None:
    """The engine's paged forward differs from the dense one here by float noise: a top-p cut
    this close to a boundary could fall the other way there."""
    scaled = logits.astype(np.float64) / params.temperature
    top = np.sort(scaled, axis=-1)[:, ::-1][:, :params.top_k]
    top = np.exp(top - top[:, :1])
    top /= top.sum(axis=-1, keepdims=True)
    mass_before = np.cumsum(top, axis=-1) - top
    assert np.abs(mass_before - params.top_p).min() > 1e-4


def sample_joint(model: Llama, spec: SpeculativeConfig | None, n: int
                 ) -> tuple[collections.Counter, dict[str, float]]:
    """First NUM_TOKENS tokens of n requests with seeds 0..n-1, all in one engine."""
    # Two slots: prefill takes one row per step and steps alternate, so more slots would hold
    # barely more rows per verify step (~1.3 at 64 slots) yet compile a program per row bucket.
    # Two still put a row with drafts beside one without (its first token was not 6).
    engine = Engine(model, None, EngineConfig(max_num_seqs=2, max_prefill_tokens=16,
                                              max_model_len=32, page_size=4, speculative=spec))
    ids = [engine.add_request(prompt_token_ids=PROMPT, params=SamplingParams(seed=i, **SAMPLING))
           for i in range(n)]
    finished = {out.request_id: out for out in engine.stream() if out.finished}
    counts = collections.Counter(tuple(finished[i].token_ids[:NUM_TOKENS]) for i in ids)
    return counts, engine.speculative_stats()


def chi_square_pvalue(counts: collections.Counter, law: dict[tuple[int, ...], float]) -> float:
    """Goodness of fit; outcomes expected fewer than 5 times are pooled into one cell (about 28
    expected here), with any outcome the law gives probability 0."""
    n = sum(counts.values())
    total = sum(law.values())
    expected = {k: n * v / total for k, v in law.items()}
    big = [k for k, e in expected.items() if e >= 5]
    obs = [counts.get(k, 0) for k in big]
    exp = [expected[k] for k in big]
    rest_obs = n - sum(obs)
    rest_exp = n - sum(exp)
    if rest_exp > 0 or rest_obs > 0:
        # An outcome outside the support with nothing expected there cannot be scored by
        # chi-square; give it an expectation so small that one sighting fails the test.
        obs.append(rest_obs)
        exp.append(max(rest_exp, 1e-9))
    return float(stats.chisquare(obs, exp).pvalue)


def test_exact_law_is_plain_sampling(tiny_model, exact_law) -> None:
    """The reference is what the engine samples without speculation."""
    counts, _ = sample_joint(tiny_model, None, NUM_REQUESTS)
    assert chi_square_pvalue(counts, exact_law) > 1e-3


@pytest.mark.parametrize("method", sorted(SPECS))
def test_speculative_sampling_keeps_the_joint_law(tiny_model, exact_law, method) -> None:
    counts, spec_stats = sample_joint(tiny_model, SPECS[method], NUM_REQUESTS)
    # Without both outcomes of the acceptance test, the law would say nothing about the rule;
    # more drafts than drafting rows: the chain's second position was verified too.
    assert 0 < spec_stats["accepted"] < spec_stats["proposed"], spec_stats
    assert spec_stats["proposed"] > spec_stats["rows"], spec_stats
    assert chi_square_pvalue(counts, exact_law) > 1e-3


def test_a_reduced_draft_vocabulary_keeps_the_joint_law(tiny_model, exact_law, tmp_path
                                                        ) -> None:
    """FR-Spec: the self-draft scores 16 ids only, two of the target's likely tokens here (6, 183)
    and 14 it never samples here. Its q is 0 at every other token the target samples (1, 414,
    348, ...): those come only from the residual of a rejection."""
    support = {t for outcome in exact_law for t in outcome}
    assert {6, 183, 1, 414} <= support
    filler = [t for t in range(TINY.vocab_size) if t not in support]
    path = str(tmp_path / "ranking.npy")
    np.save(path, np.asarray([6, 183] + filler, np.int32))
    spec = SpeculativeConfig("self_draft", 2, self_draft_layers=1, draft_vocab_size=16,
                             draft_vocab_path=path)
    counts, spec_stats = sample_joint(tiny_model, spec, NUM_REQUESTS)
    assert 0 < spec_stats["accepted"] < spec_stats["proposed"], spec_stats
    assert spec_stats["proposed"] > spec_stats["rows"], spec_stats
    assert chi_square_pvalue(counts, exact_law) > 1e-3


def accept_with_p(target_probs, draft_probs, draft_tokens, num_draft, key):
    """Wrong: q taken as 1, so a draft is accepted with probability p(d) instead of
    min(1, p(d) / q(d)), and a rejection resamples from p instead of the residual
    max(p - q, 0) (the only error left for a point-mass n-gram draft)."""
    return verify_sampled(target_probs, jnp.ones_like(draft_probs), draft_tokens, num_draft, key)


@pytest.mark.parametrize("method", sorted(SPECS))
def test_a_wrong_acceptance_rule_fails(tiny_model, exact_law, monkeypatch, method) -> None:
    # verify_chain looks verify_sampled up in its module when an engine's verify step is first
    # traced, so patching the name there before the engine runs reaches the jit.
    monkeypatch.setattr(infer.spec.verify, "verify_sampled", accept_with_p)
    counts, spec_stats = sample_joint(tiny_model, SPECS[method], NUM_REQUESTS)
    assert spec_stats["proposed"] > 0
    assert chi_square_pvalue(counts, exact_law) < 1e-6


def test_a_confidence_stop_keeps_the_joint_law(tiny_model, exact_law) -> None:
    """The stop decides from each draft's top probability, known before the draw: rows whose
    chain it ends take fewer drafts (or a plain step), and the law is unchanged. (A stop on the
    drawn token's own probability would keep only some draws, a law other than q.)"""
    spec = SpeculativeConfig("self_draft", 2, self_draft_layers=1,
                             draft_confidence=CONFIDENCE_STOP)
    counts, spec_stats = sample_joint(tiny_model, spec, NUM_REQUESTS)
    _, full_stats = sample_joint(tiny_model, SPECS["self_draft"], NUM_REQUESTS // 4)
    assert 0 < spec_stats["accepted"] < spec_stats["proposed"], spec_stats
    assert spec_stats["proposed"] > spec_stats["rows"], spec_stats  # second drafts too
    # Stopped: fewer drafts per request than without the stop (the seeds are the same).
    assert spec_stats["proposed"] < 0.95 * 4 * full_stats["proposed"], (spec_stats, full_stats)
    assert chi_square_pvalue(counts, exact_law) > 1e-3
