"""The padding rules of `infer.engine.buckets`."""

from __future__ import annotations

import numpy as np

from infer.engine.buckets import bucket_for, powers_of_two, with_midpoints


def test_midpoint_buckets_pad_a_length_to_at_most_one_and_a_half_times_it() -> None:
    """`with_midpoints` over powers of two, random ranges: the buckets stay sorted and keep the
    originals and the largest; every length from the smallest bucket on pads to at most 1.5
    times itself (twice, without the midpoints)."""
    rng = np.random.default_rng()
    for _ in range(50):
        lo = 1 << int(rng.integers(0, 6))
        hi = int(rng.integers(lo, 3000))
        base = powers_of_two(lo, hi)
        buckets = with_midpoints(base)
        assert list(buckets) == sorted(set(buckets)) and set(base) <= set(buckets)
        assert buckets[-1] == hi
        for n in range(lo, hi + 1):
            assert n <= bucket_for(n, buckets) <= 1.5 * n, (lo, hi, n, buckets)
