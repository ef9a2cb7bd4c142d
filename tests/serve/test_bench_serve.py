"""experiments.bench_serve: vLLM's arrival process and random dataset, its metric definitions,
and a run against the server whose counts agree with what the server says it served."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

pytest.importorskip("aiohttp")
from experiments import bench_serve  # noqa: E402
from experiments.bench_serve import Measured, Scheduled  # noqa: E402


@pytest.mark.parametrize("seed", range(5))
def test_arrivals_end_at_n_over_rate_with_gamma_gaps(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, rate, burst = int(rng.integers(50, 400)), float(rng.uniform(0.5, 20)), float(
        rng.choice([0.5, 1.0, 3.0]))
    t = bench_serve.arrival_offsets(n, rate, burst, seed)
    assert t.shape == (n,) and np.all(np.diff(t) >= 0) and t[0] > 0
    assert math.isclose(t[-1], n / rate, rel_tol=1e-12)
    gaps = np.diff(np.concatenate([[0.0], t]))
    cv = gaps.std() / gaps.mean()  # a gamma of shape b has a coefficient of variation 1/sqrt(b)
    assert abs(cv - 1 / math.sqrt(burst)) < 0.35 / math.sqrt(burst), (cv, burst)
    assert np.array_equal(t, bench_serve.arrival_offsets(n, rate, burst, seed))
    assert not np.array_equal(t, bench_serve.arrival_offsets(n, rate, burst, seed + 1))
    assert not bench_serve.arrival_offsets(n, math.inf, burst, seed).any()


def test_random_dataset_lengths_follow_the_range(smollm2) -> None:
    tokenizer = smollm2[2]
    data = bench_serve.random_dataset(tokenizer, 40, 48, 20, 0.25, seed=3)
    assert len({p for p, _, _ in data}) == 40  # different offsets, different prompts
    for prompt, prompt_len, output_len in data:
        assert len(tokenizer.encode(prompt)) == prompt_len
        assert 36 - 2 <= prompt_len <= 60 + 2  # a decode/encode round trip may merge a token
        assert 15 <= output_len <= 25
    assert data == bench_serve.random_dataset(tokenizer, 40, 48, 20, 0.25, seed=3)


def test_summary_uses_vllms_definitions() -> None:
    a = Measured(ok=True, ttft_s=0.5, latency_s=2.5, itl_s=[0.5, 0.5, 1.0], output_tokens=5,
                 prompt_tokens=10, start_s=0.0)
    b = Measured(ok=True, ttft_s=2.0, latency_s=2.0, itl_s=[], output_tokens=1, prompt_tokens=7,
                 start_s=1.0)
    c = Measured(ok=False, error="HTTP 500")
    row = bench_serve.summarize([a, b, c], duration_s=4.0, percentiles=[50, 99],
                                goodput_ms={"ttft": 1000, "tpot": 600})
    assert row["completed"] == 2 and row["failed"] == 1 and row["errors"] == ["HTTP 500"]
    assert row["request_throughput"] == 0.5 and row["output_throughput"] == 6 / 4
    assert row["total_token_throughput"] == 23 / 4
    assert row["mean_tpot_ms"] == pytest.approx(500.0)  # (2.5 - 0.5) / (5 - 1); b has one token
    assert row["median_ttft_ms"] == pytest.approx(1250.0)
    assert row["mean_itl_ms"] == pytest.approx(2000 / 3)  # pooled gaps
    assert row["p99_e2el_ms"] == pytest.approx(np.percentile([2500, 2000], 99))
    assert row["request_goodput"] == 0.25  # b misses the TTFT SLO


def test_a_run_against_the_server_counts_what_it_served(running) -> None:
    tokenizer = running.llm.tokenizer
    items = bench_serve.schedule(tokenizer, 6, 20, 8, 0.5, rate=20.0, burstiness=1.0, seed=1)
    results, duration = asyncio.run(bench_serve.run_schedule(
        running.url, "smollm2-4l", items, max_concurrency=4, progress=False))
    assert all(m.ok for m in results), [m.error for m in results]
    assert [m.output_tokens for m in results] == [i.output_len for i in items]
    assert [m.prompt_tokens for m in results] == [i.prompt_len for i in items]
    for m in results:
        assert 0 < m.ttft_s <= m.latency_s and len(m.itl_s) >= 1
        assert m.latency_s == pytest.approx(m.ttft_s + sum(m.itl_s))
    assert duration >= max(i.offset_s for i in items)
    row = bench_serve.summarize(results, duration, [99], {"ttft": 1e9})
    assert row["request_goodput"] == pytest.approx(row["request_throughput"])
    json.dumps(row)  # a JSONL row
    replayed = [Scheduled(**s) for s in json.loads(json.dumps(
        [i.__dict__ for i in items]))]
    assert replayed == items


@pytest.mark.parametrize("parallel", [
    dict(tensor_parallel_size=1, data_parallel_size=1, pad_heads=False, dp_routing="least_loaded"),
    dict(tensor_parallel_size=2, data_parallel_size=3, pad_heads=True, dp_routing="prefix")])
def test_the_parallel_flags_reach_infers_server_as_given(parallel) -> None:
    """What bench_serve passes on the server's command line parses back to the same flags."""
    from absl import flags

    from infer.parallel.flags import define_parallel_flags, parallel_kwargs
    server_flags = flags.FlagValues()
    define_parallel_flags(server_flags)
    server_flags(["infer.serve", *bench_serve.flag_args(parallel)])
    assert parallel_kwargs(server_flags) == parallel
