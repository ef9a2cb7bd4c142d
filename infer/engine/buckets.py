"""Every padding rule of infer, in one place: sizes are padded to a few buckets, so that jit
compiles a handful of shapes instead of one per size.

- Rows of a decode batch: powers of two up to `max_num_seqs`.
- Tokens of a prefill chunk or a prompt: powers of two from `MIN_PREFILL_TOKENS`; the engine's
  chunks also 1.5 times each (`with_midpoints`) where one page-table width serves every length.
- Attention windows (a contiguous cache's slots, a page table's width in tokens): powers of two
  from `MIN_WINDOW`. Attention that gathers its window reads all of it, so a short sequence still
  pays for `MIN_WINDOW` slots; each larger power of two is one more set of programs. Where every
  step reads its rows' tokens in place (`infer.cache.paged.reads_in_place`) the width costs
  nothing and the engine compiles the longest only.
"""

from __future__ import annotations

MIN_PREFILL_TOKENS = 16  # smallest padded prompt / prefill chunk
MIN_WINDOW = 128  # smallest attention window, in tokens


def next_power_of_two(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(n, minimum, 1)
    return 1 << (n - 1).bit_length()


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2 lo, 4 lo, ... up to and including hi (hi itself added if not a power)."""
    out, n = [], lo
    while n < hi:
        out.append(n)
        n *= 2
    return tuple(out) + (hi,)


def with_midpoints(buckets: tuple[int, ...]) -> tuple[int, ...]:
    """The buckets and 1.5 times each below the largest (16, 24, 32, 48, ... for powers of two):
    a length from the smallest on then pads to at most 1.5 times itself instead of twice."""
    mids = [b * 3 // 2 for b in buckets[:-1] if b % 2 == 0]
    return tuple(sorted(set(buckets) | {m for m in mids if m < buckets[-1]}))


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= n; ValueError if n exceeds the largest."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]} of {buckets}")


def prompt_bucket(n: int, cap: int | None = None) -> int:
    """Padded length of a prompt of n tokens (a power of two >= MIN_PREFILL_TOKENS), at most cap."""
    padded = next_power_of_two(n, MIN_PREFILL_TOKENS)
    return padded if cap is None else min(padded, cap)


def window_bucket(tokens: int, cap: int | None = None, minimum: int = MIN_WINDOW) -> int:
    """The attention window that holds `tokens` tokens: a power of two >= minimum, at most cap."""
    window = next_power_of_two(tokens, minimum)
    return window if cap is None else min(window, cap)
