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
