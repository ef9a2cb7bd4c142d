"""Engines the tests build on the tiny random model, and checks of what engines return."""

from __future__ import annotations

import numpy as np

from infer.engine.engine import Engine, EngineConfig
from infer.io.tokenizer import Tokenizer
from infer.model.llama import Llama
from infer.sampling_params import SamplingParams
from infer.spec.config import SpeculativeConfig


def tiny_engine(model: Llama, **overrides) -> Engine:
    config = dict(max_num_seqs=4, max_prefill_tokens=16, max_model_len=64, page_size=4)
    config.update(overrides)
    return Engine(model, None, EngineConfig(**config))


def run_jobs(engine: Engine, jobs: list[tuple[list[int], SamplingParams]]) -> list:
    """Each (prompt ids, params) job through `engine` until done: their final outputs, in the
    jobs' order."""
    ids = [engine.add_request(prompt_token_ids=p, params=s) for p, s in jobs]
    outputs = {o.request_id: o for o in engine.stream() if o.finished}
    return [outputs[i] for i in ids]


def serve(model: Llama, tokenizer: Tokenizer | None, requests: list[list[int]],
          spec: SpeculativeConfig | None, params: SamplingParams, **overrides
          ) -> tuple[list[list[int]], dict[str, float]]:
    """Every request through one small engine with speculation `spec` until done: each
    request's tokens, and the engine's speculative stats with the requests' preemptions. The
    pages come back whole: every one free, or held by the prefix cache alone."""
    config = dict(max_num_seqs=4, max_prefill_tokens=16, max_model_len=96, page_size=4,
                  speculative=spec)
    config.update(overrides)
    engine = Engine(model, tokenizer, EngineConfig(**config))
    ids = [engine.add_request(prompt_token_ids=p, params=params) for p in requests]
    engine.run_until_done()
    engine.allocator.check_invariants()
    if not config.get("enable_prefix_caching"):
        assert engine.allocator.num_free() == engine.allocator.num_pages
    outputs = [engine.output(i) for i in ids]
    return [o.token_ids for o in outputs], {
        **engine.speculative_stats(),
        "preemptions": sum(o.metrics.num_preemptions for o in outputs)}


def check_logprobs(ref: np.ndarray, out, k: int, atol: float) -> None:
    """An output's logprobs against reference logprobs [T, V] of its T tokens (each row: the
    distribution the token was drawn from): chosen value and rank, and k top alternatives
    whose values are the reference's largest. Ids are compared through their values, so that
    tokens within atol of each other may come in either order."""
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == len(ref)
    for row, token, lp in zip(ref, out.token_ids, out.logprobs):
        assert lp.token_id == token
        np.testing.assert_allclose(lp.logprob, row[token], atol=atol)
        assert (1 + np.sum(row > row[token] + atol) <= lp.rank
                <= 1 + np.sum(row > row[token] - atol))
        assert len(lp.top) == k
        values = [v for _, v in lp.top]
        np.testing.assert_allclose(values, row[[t for t, _ in lp.top]], atol=atol)
        np.testing.assert_allclose(values, np.sort(row)[::-1][:k], atol=atol)
