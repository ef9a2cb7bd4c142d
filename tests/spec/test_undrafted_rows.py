"""Rows that ask for logprobs draft nothing, while their batch-mates verify drafts in the same
steps. Such a row samples as plain decoding does (the token stream, its logprobs): its tokens
and logprobs are a plain engine's whatever its batch-mates draft, with a chain of n-gram
drafts, a draft model and an EAGLE tree. Random prompts and params, a fresh seed per run.
(Structured output, the other per-position feature, is tests/engine/test_structured.py's.)"""

from __future__ import annotations

import numpy as np
import pytest

from infer.sampling_params import SamplingParams
from infer.spec.config import SpeculativeConfig
from tests.engines import run_jobs, tiny_engine


def _jobs(rng: np.random.Generator, vocab: int) -> list[tuple[list[int], SamplingParams]]:
    jobs = []
    for i in range(6):
        if i % 2:  # repetitive: n-gram lookup finds drafts at once
            prompt = rng.integers(1, vocab, int(rng.integers(2, 5))).tolist() * 4
        else:
            prompt = rng.integers(1, vocab, int(rng.integers(3, 20))).tolist()
        # Two logprobs rows sample; a greedy repetitive row drafts at every step.
        sampled = i in (2, 3) or (i != 1 and bool(rng.integers(2)))
        jobs.append((prompt, SamplingParams(
            max_tokens=int(rng.integers(6, 15)), ignore_eos=True,
            # The random model's logit gaps are ~15: temperatures like these spread its mass.
            temperature=float(rng.uniform(5.0, 12.0)) if sampled else 0.0,
            top_k=int(rng.choice([0, 20])), seed=int(rng.integers(2**31)),
            # Every other request asks for logprobs: each batch mixes both kinds.
            logprobs=int(rng.integers(0, 4)) if i % 2 == i // 3 % 2 else None)))
    return jobs


def _specs(weights: dict[str, str]) -> dict[str, SpeculativeConfig]:
    return {"ngram": SpeculativeConfig("ngram", 3),
            "draft": SpeculativeConfig("draft", 2, draft_path=weights["draft"]),
            "eagle tree": SpeculativeConfig("eagle", eagle_path=weights["eagle"], tree="2x2")}


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle tree"])
def test_rows_without_drafts_sample_as_plain_decoding(tiny_model, tiny_weights, method) -> None:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    jobs = _jobs(np.random.default_rng(seed), tiny_model.config.vocab_size)
    plain = run_jobs(tiny_engine(tiny_model), jobs)
    engine = tiny_engine(tiny_model, speculative=_specs(tiny_weights)[method])
    outs = run_jobs(engine, jobs)
    # Steps that verified drafts held rows asking for logprobs: the variant compiled for them.
    assert any(s.kind in ("verify", "tree") and s.logprobs for s in engine.runner.ready), seed
    assert engine.speculative_stats()["proposed"] > 0, seed
    for (_, params), want, got in zip(jobs, plain, outs):
        if params.logprobs is None:
            if params.greedy:  # a sampled row that drafts draws from the verify stream
                assert got.token_ids == want.token_ids, (seed, method)
            continue
        assert got.token_ids == want.token_ids, (seed, method)
        for a, b in zip(got.logprobs, want.logprobs):
            assert (a.token_id, a.rank) == (b.token_id, b.rank), (seed, method)
            np.testing.assert_allclose(a.logprob, b.logprob, atol=2e-5)
            assert [t for t, _ in a.top] == [t for t, _ in b.top], (seed, method)
            np.testing.assert_allclose([v for _, v in a.top], [v for _, v in b.top], atol=2e-5)
