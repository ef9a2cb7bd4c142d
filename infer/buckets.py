"""Padding sizes to a few buckets, so that jit compiles a handful of shapes instead of one per size."""

from __future__ import annotations


def next_power_of_two(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(n, minimum, 1)
    return 1 << (n - 1).bit_length()


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= n; ValueError if n exceeds the largest."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]} of {buckets}")
