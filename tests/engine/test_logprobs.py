"""Logprobs from the engine: each output token's logprob, rank and top alternatives equal the
log_softmax of a full forward over prompt and output, on every path that samples (prefill,
decode, decode planned ahead, mixed steps), greedy and sampled."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infer.cache.contiguous import KVCache
from infer.cache.metadata import AttentionMetadata
from infer.sampling_params import SamplingParams
from infer.spec.config import SpeculativeConfig
from tests.engines import check_logprobs, run_jobs, tiny_engine


@functools.cache
def _forward(model):
    """One jitted full forward per model at one padded length: eager calls would compile every
    op anew for each sequence length."""
    c = model.config

    @jax.jit
    def logprobs(ids, length):
        cache = KVCache.create(c.num_layers, 1, ids.shape[1], c.num_kv_heads, c.head_dim)
        logits, _, _ = model(ids, cache,
                             AttentionMetadata.for_prefill(length[None], ids.shape[1]))
        return jax.nn.log_softmax(logits[0].astype(jnp.float32), axis=-1)

    return logprobs


def _full_logprobs(model, ids: list[int], padded: int = 64) -> np.ndarray:
    """log_softmax of one full forward over `ids` (a contiguous cache, no engine) [T, V]. The
    padding after the last token changes nothing before it (attention is causal)."""
    tokens = np.zeros((1, padded), np.int32)
    tokens[0, :len(ids)] = ids
    return np.asarray(_forward(model)(jnp.asarray(tokens), jnp.asarray(len(ids))))[:len(ids)]


def check_against_forward(model, prompt: list[int], out, k: int) -> None:
    check_logprobs(_full_logprobs(model, prompt + out.token_ids)[len(prompt) - 1:-1], out, k,
                   atol=2e-5)


def _jobs(rng: np.random.Generator, vocab: int, n: int) -> list[tuple[list[int], SamplingParams]]:
    jobs = []
    for i in range(n):
        prompt = rng.integers(1, vocab, int(rng.integers(2, 24))).tolist()
        temperature = float(rng.choice([0.0, 0.8, 1.0]))
        jobs.append((prompt, SamplingParams(temperature=temperature, seed=i,
                                            max_tokens=int(rng.integers(1, 12)),
                                            logprobs=int(rng.integers(0, 6)), ignore_eos=True)))
    return jobs


@pytest.mark.parametrize("options", [dict(), dict(async_scheduling=False),
                                     dict(mixed_steps=True)], ids=["async", "sync", "mixed"])
def test_logprobs_equal_a_full_forward_on_every_path(tiny_model, options) -> None:
    rng = np.random.default_rng(len(options) + 7 * ("mixed_steps" in options))
    engine = tiny_engine(tiny_model, **options)
    jobs = _jobs(rng, tiny_model.config.vocab_size, 6)
    # A row that asks for none shares the batch, and gets none.
    jobs.append(([5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True)))
    outs = run_jobs(engine, jobs)
    assert outs[-1].logprobs is None
    for (prompt, params), out in zip(jobs[:-1], outs):
        check_against_forward(tiny_model, prompt, out, params.logprobs)
        if params.greedy:
            assert all(lp.rank == 1 for lp in out.logprobs)
    if options.get("mixed_steps"):
        assert any(r.kind == "mixed" for r in engine.records)
    if not options:
        assert any(r.planned_ahead for r in engine.records)


def test_logprobs_do_not_change_the_tokens(tiny_model) -> None:
    """The logprobs variant samples exactly as the plain program does."""
    rng = np.random.default_rng(3)
    jobs = _jobs(rng, tiny_model.config.vocab_size, 6)
    plain = [(p, dataclasses.replace(s, logprobs=None)) for p, s in jobs]
    engine = tiny_engine(tiny_model)
    assert ([o.token_ids for o in run_jobs(engine, jobs)]
            == [o.token_ids for o in run_jobs(engine, plain)])


def test_logprob_rows_draft_nothing_beside_rows_that_do(tiny_model) -> None:
    """A row asking for logprobs drafts nothing; its batch-mate verifies drafts in the same
    steps. Both keep a plain engine's tokens; the logprobs are a full forward's."""
    # Repetitive prompts: n-gram lookup proposes drafts for them at once.
    jobs = [([5, 6, 7, 8] * 4 + [5, 6], SamplingParams(max_tokens=10, logprobs=2,
                                                       ignore_eos=True)),
            ([9, 10, 11] * 5 + [9], SamplingParams(max_tokens=8, ignore_eos=True))]
    expected = [o.token_ids for o in run_jobs(tiny_engine(tiny_model), jobs)]
    spec = tiny_engine(tiny_model, speculative=SpeculativeConfig(method="ngram", num_tokens=2))
    outs = run_jobs(spec, jobs)
    assert [o.token_ids for o in outs] == expected
    check_against_forward(tiny_model, jobs[0][0], outs[0], 2)
    assert outs[1].logprobs is None
    stats = spec.speculative_stats()
    # One row drafted in each verify step, and verify steps held the logprobs row (their
    # logprobs variant compiled).
    assert stats["verify_steps"] > 0 and stats["rows"] == stats["verify_steps"], stats
    assert any(s.kind == "verify" and s.logprobs for s in spec.runner.ready)
