"""RequestMetrics.from_token_times, which the engine calls (through Request.metrics) for every
running request at every step and the serving peers call once per stream: the latencies by
their definitions, at random token times (none, one, many; times far from zero, where float64
differences round)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from infer.engine.request import Request, RequestMetrics
from infer.sampling_params import SamplingParams


def test_latencies_follow_their_definitions_at_random_token_times() -> None:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    for _ in range(300):
        n = int(rng.choice([0, 1, 2, int(rng.integers(3, 400))]))
        arrival = float(rng.uniform(0, 1e6))
        times = (arrival + np.cumsum(rng.exponential(0.05, n))).tolist()
        finished = bool(rng.integers(2))
        m = RequestMetrics.from_token_times(arrival, times, 7, finished, num_cached_tokens=3,
                                           num_preemptions=1)
        assert m.num_output_tokens == n and m.num_prompt_tokens == 7, seed
        assert (m.num_cached_tokens, m.num_preemptions) == (3, 1)
        assert m.itl_s == tuple(b - a for a, b in zip(times, times[1:])), seed
        assert all(type(x) is float for x in m.itl_s)
        if n == 0:
            assert m.ttft_s is None and m.tpot_s is None and m.e2e_s is None
            continue
        assert m.ttft_s == times[0] - arrival
        assert m.e2e_s == (times[-1] - arrival if finished else None)
        if n == 1:
            assert m.tpot_s is None
        else:
            assert math.isclose(m.tpot_s, math.fsum(m.itl_s) / (n - 1), rel_tol=1e-12), seed


def test_tokens_of_one_step_count_one_inter_token_latency() -> None:
    """A speculative step emits several tokens at one time: vLLM's ITL counts the step once,
    TPOT still counts every token. Random steps of 1-5 tokens."""
    from infer.engine.metrics import summarize

    rng = np.random.default_rng()
    sizes = rng.integers(1, 6, int(rng.integers(2, 40)))
    step_times = np.cumsum(rng.exponential(0.05, len(sizes)) + 1e-3)
    times = np.repeat(step_times, sizes).tolist()
    m = RequestMetrics.from_token_times(0.0, times, 5)
    assert m.num_output_tokens == sizes.sum() and len(m.itl_s) == sizes.sum() - 1
    assert m.step_gaps == tuple(np.diff(step_times).tolist())
    assert math.isclose(m.tpot_s, (times[-1] - times[0]) / (len(times) - 1), rel_tol=1e-9)
    row = summarize([m], wall_s=1.0)
    assert row["itl_s_p50"] == pytest.approx(float(np.median(np.diff(step_times))))


def test_request_keeps_gaps_as_tokens_come_equal_to_recomputing_them() -> None:
    """Request.metrics() passes the gaps it appends token by token; at every step they must be
    the ones from_token_times computes from the times alone."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    for _ in range(20):
        n = int(rng.integers(1, 200))
        arrival = float(rng.uniform(0, 1e6))
        times = (arrival + np.cumsum(rng.exponential(0.05, n))).tolist()
        request = Request("r", [1, 2, 3], SamplingParams(max_tokens=n, ignore_eos=True), None,
                          arrival_s=arrival)
        for i, now in enumerate(times):
            request.append(int(rng.integers(100)), now=now)
            got = request.metrics()
            want = RequestMetrics.from_token_times(arrival, times[:i + 1], 3, i + 1 == n)
            assert got == want, (seed, i)
        assert request.finished


def test_gaps_that_do_not_match_the_times_are_refused() -> None:
    with pytest.raises(ValueError, match="2 gaps between 4 token times"):
        RequestMetrics.from_token_times(0.0, [1.0, 2.0, 3.0, 4.0], 1, gaps=[1.0, 1.0])


def test_gaps_since_are_the_waited_gaps_a_step_adds() -> None:
    """Engine.step observes `gaps_since(tokens before the step)` in its ITL histogram: over a
    request's steps they must add up to the request's own `step_gaps`, step by step. Random
    steps of 1-5 tokens sharing one time (speculation), some steps of none."""
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    for _ in range(50):
        sizes = rng.integers(0, 6, int(rng.integers(1, 30)))
        total = max(int(sizes.sum()), 1)
        request = Request("r", [1], SamplingParams(max_tokens=total, ignore_eos=True), None,
                          arrival_s=0.0)
        now, observed = 0.0, []
        for size in sizes:
            now += float(rng.exponential(0.05)) + 1e-3
            before = len(request.output_ids)
            for _ in range(size):
                request.append(int(rng.integers(100)), now=now)
            step = request.gaps_since(before)
            assert len(step) == (1 if size and before else 0), (seed, before, size)
            if step:
                assert step[0] == now - request.token_times[before - 1], seed
            observed += step
        assert tuple(observed) == request.metrics().step_gaps, seed
