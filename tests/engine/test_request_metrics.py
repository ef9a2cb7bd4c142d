"""RequestMetrics.from_token_times, which the engine calls for every running request at every
step and the serving peers call once per stream: the latencies by their definitions, at random
token times (none, one, many; times far from zero, where float64 differences round)."""

from __future__ import annotations

import math

import numpy as np

from infer.engine.request import RequestMetrics


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
