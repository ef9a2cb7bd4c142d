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

import infer.spec.verify
from infer.engine.engine import Engine, EngineConfig
from infer.model.config import get_config
from infer.model.llama import Llama
from infer.sampling_params import SamplingParams
from infer.spec.config import SpeculativeConfig
from infer.sampling import inverse_cdf_pick
from infer.spec.verify import verify_sampled, verify_tree_sampled
from tests.spec.joint_law import chi_square_pvalue, exact_joint

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
def test_a_wrong_acceptance_rule_fails(tiny_model, exact_law, monkeypatch, method,
                                      fresh_programs) -> None:
    # verify_chain looks verify_sampled up in its module when an engine's verify step is first
    # traced, so patching the name there before the engine runs reaches the jit (programs of
    # its own: `fresh_programs`).
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


@pytest.fixture
def tree_spec(exact_law, tiny_weights, tmp_path) -> SpeculativeConfig:
    """A 2 x 2 EAGLE tree (the random head) whose draft vocabulary is 6 and 183, two of the
    target's likely tokens here: every node's two children are those two, so a row's
    candidates (two here: max_tokens leaves room for two) are siblings, tried one after the
    other."""
    support = {t for outcome in exact_law for t in outcome}
    filler = [t for t in range(TINY.vocab_size) if t not in support]
    path = str(tmp_path / "ranking.npy")
    np.save(path, np.asarray([6, 183] + filler, np.int32))
    return SpeculativeConfig("eagle", eagle_path=tiny_weights["eagle"], tree="2x2",
                             draft_vocab_size=2, draft_vocab_path=path)


def test_an_engine_tree_keeps_the_joint_law(tiny_model, exact_law, tree_spec) -> None:
    counts, spec_stats = sample_joint(tiny_model, tree_spec, NUM_REQUESTS)
    assert 0 < spec_stats["accepted"] < spec_stats["rows"], spec_stats
    # Both siblings in most rows (one where a single token is left to draft).
    assert 1.5 * spec_stats["rows"] < spec_stats["proposed"] <= 2 * spec_stats["rows"], spec_stats
    assert chi_square_pvalue(counts, exact_law) > 1e-3


def emit_from_p(target_probs, tree_tokens, parents, key, max_depth=None):
    """Wrong: where the walk stops, the emitted token is a fresh draw from the target's p at
    that node instead of the draw that matched no child, so tokens that are children get
    emitted after being rejected (the tree form of resampling from p, not the residual)."""
    path, accepted, _ = verify_tree_sampled(target_probs, tree_tokens, parents, key, max_depth)
    last = jnp.take_along_axis(path, accepted[:, None], axis=1)[:, 0]
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1), minval=1e-30))(key)
    probs = jnp.take_along_axis(target_probs, last[:, None, None], axis=1)[:, 0]
    return path, accepted, inverse_cdf_pick(u, probs)


def test_a_wrong_tree_rule_fails(tiny_model, exact_law, tree_spec, monkeypatch,
                                 fresh_programs) -> None:
    # verify_tree looks verify_tree_sampled up in its module when the engine's tree verify
    # step is first traced.
    monkeypatch.setattr(infer.spec.verify, "verify_tree_sampled", emit_from_p)
    counts, spec_stats = sample_joint(tiny_model, tree_spec, NUM_REQUESTS)
    assert spec_stats["proposed"] > 0
    assert chi_square_pvalue(counts, exact_law) < 1e-6
