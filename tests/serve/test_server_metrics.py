"""The /metrics gauges against the engine state they describe."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from infer.model.config import get_config
from infer.model.llama import Llama
from infer.sampling_params import SamplingParams
from tests.engines import tiny_engine

pytest.importorskip("prometheus_client")
from infer.serve.metrics import ServerMetrics  # noqa: E402


def _kv_usage(engine) -> float:
    """The gauge as a scraper reads it."""
    from prometheus_client.parser import text_string_to_metric_families

    metrics = ServerMetrics("tiny")
    metrics.engine_state([engine])
    text = metrics.exposition().decode()
    (value,) = [s.value for family in text_string_to_metric_families(text)
                for s in family.samples if s.name == "vllm:kv_cache_usage_perc"]
    return value


def test_kv_usage_counts_pages_only_the_prefix_cache_holds_as_free() -> None:
    """An idle engine whose prefix cache keeps finished requests' pages is not "full": those
    pages are evicted on demand, as vLLM's free queue holds its cached blocks."""
    engine = tiny_engine(Llama(get_config("tiny"), jnp.float32, nnx.Rngs(3)),
                         enable_prefix_caching=True, num_pages=32)
    rng = np.random.default_rng()
    prompt = rng.integers(3, 500, int(rng.integers(20, 41))).tolist()
    engine.add_request(prompt_token_ids=prompt, params=SamplingParams(max_tokens=16,
                                                                      ignore_eos=True))
    engine.step()  # the prompt's first chunk: its pages are in use
    held = engine.allocator.num_pages - engine.allocator.num_free()
    assert held > 0 and _kv_usage(engine) == pytest.approx(held / engine.allocator.num_pages)
    engine.run_until_done()
    assert len(engine.prefix_cache) > 0  # the finished request's full pages stayed cached
    assert _kv_usage(engine) == 0.0


def _drive(engine, metrics: ServerMetrics, rng: np.random.Generator, prompts: list[list[int]],
           abort_share: float, max_tokens: int = 12, each_step=None) -> list[str]:
    """Feeds `metrics` as the server's worker does: each step's records, and the final output
    of each request that finished or was aborted; a share of the requests is aborted while
    still queued. Returns the ids of the requests that ran."""
    ids = [engine.add_request(prompt_token_ids=p, params=SamplingParams(
        max_tokens=int(rng.integers(1, max_tokens)), ignore_eos=True)) for p in prompts]
    queued = [i for i in ids if rng.random() < abort_share]
    for request_id in queued:
        out = engine.abort(request_id)
        assert out is not None and not out.token_ids
        metrics.finished(out)
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        first = engine.num_steps
        outputs = engine.step()
        metrics.steps(engine.step_records(first))
        for out in outputs:
            if out.finished:
                metrics.finished(out)
        if each_step is not None:
            each_step([engine.output(i) for i in ids if i not in queued])
    return [i for i in ids if i not in queued]


def _sample(metrics: ServerMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": "tiny", "engine": "0"})


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_cache_counters_are_the_prefix_caches_own_lookups(tiny_model,
                                                                 caching: bool) -> None:
    """Queries and hits count the tokens the prefix cache looked up and handed out, when it
    did (vLLM counts at the scheduler's lookup): a request aborted while queued was never
    looked up, a preempted one is looked up again, and with prefix caching off nothing is."""
    rng = np.random.default_rng()
    shared = [rng.integers(3, 200, int(rng.integers(4, 21))).tolist() for _ in range(3)]
    prompts = [shared[int(rng.integers(3))] + rng.integers(3, 200, int(rng.integers(1, 9))
                                                           ).tolist() for _ in range(20)]
    engine = tiny_engine(tiny_model, enable_prefix_caching=caching, num_pages=12,
                         max_model_len=48)  # 4 slots of up to 12 pages each: preemptions
    metrics = ServerMetrics("tiny")
    ran = _drive(engine, metrics, rng, prompts, abort_share=0.3, max_tokens=21)
    assert ran and _sample(metrics, "vllm:num_preemptions_total") > 0
    queries = _sample(metrics, "vllm:prefix_cache_queries_total")
    hits = _sample(metrics, "vllm:prefix_cache_hits_total")
    if not caching:
        assert queries == hits == 0
        return
    stats = engine.prefix_cache_stats()
    assert (queries, hits) == (stats["lookup_tokens"], stats["hit_tokens"])
    assert stats["lookups"] >= len(ran)  # a preempted request is looked up again


@pytest.mark.parametrize("spec", [False, True])
def test_ttft_and_inter_token_latency_are_observed_as_tokens_come(tiny_model,
                                                                  spec: bool) -> None:
    """After every step the histograms hold each first token and each inter-token gap so far,
    of running requests too (vLLM observes them per step, not when a request finishes): one
    gap per step that brought a request tokens, several tokens a step with speculation."""
    from infer.spec.config import SpeculativeConfig

    rng = np.random.default_rng()
    prompts = [rng.integers(3, 60, int(rng.integers(1, 30))).tolist() for _ in range(9)]
    prompts += [[5, 6, 7, 8] * 4]  # the n-gram proposer drafts on it
    engine = tiny_engine(tiny_model, max_model_len=96, num_pages=24,
                         speculative=SpeculativeConfig("ngram", 3) if spec else None)
    metrics = ServerMetrics("tiny")
    checked = []

    def each_step(outputs) -> None:
        ttfts = [o.metrics.ttft_s for o in outputs if o.metrics.ttft_s is not None]
        gaps = [g for o in outputs for g in o.metrics.step_gaps]
        assert _sample(metrics, "vllm:time_to_first_token_seconds_count") == len(ttfts)
        assert _sample(metrics, "vllm:time_to_first_token_seconds_sum") == pytest.approx(
            sum(ttfts))
        assert _sample(metrics, "vllm:inter_token_latency_seconds_count") == len(gaps)
        assert _sample(metrics, "vllm:inter_token_latency_seconds_sum") == pytest.approx(
            sum(gaps))
        checked.append(any(not o.finished and o.token_ids for o in outputs))

    _drive(engine, metrics, rng, prompts, abort_share=0.2, max_tokens=24, each_step=each_step)
    assert any(checked)  # some step left a request running with tokens


def test_prefix_queries_count_every_token_of_each_lookup(tiny_model) -> None:
    """vLLM's prefix-cache queries add each looked-up request's num_tokens (its last token
    included, though never matched): with pages to spare and nothing aborted, every prompt is
    looked up once, so the queries are the prompts' tokens."""
    rng = np.random.default_rng()
    shared = rng.integers(3, 200, int(rng.integers(5, 20))).tolist()
    prompts = [shared + rng.integers(3, 200, int(rng.integers(0, 6))).tolist()
               for _ in range(int(rng.integers(2, 8)))]
    engine = tiny_engine(tiny_model, enable_prefix_caching=True)
    for prompt in prompts:
        engine.add_request(prompt_token_ids=prompt,
                           params=SamplingParams(max_tokens=2, ignore_eos=True))
    engine.run_until_done()
    stats = engine.prefix_cache_stats()
    assert stats["lookups"] == len(prompts)
    assert stats["lookup_tokens"] == sum(map(len, prompts)), (stats, prompts)
    assert sum(r.prefix_queried_tokens for r in engine.records) == stats["lookup_tokens"]
