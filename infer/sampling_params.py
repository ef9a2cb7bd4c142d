"""Sampling parameters of one request, validated on the host. Plain Python: the scheduler, the
request and a server import them without loading JAX (`infer.sampling` turns them into the
device's per-row arrays)."""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets

import numpy as np


def is_integer(x: object) -> bool:
    """An int or numpy integer, but not a bool (True is an int in Python: max_tokens=True is a
    mistake, not 1 token)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))

def _real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))

def _finite(x: numbers.Real) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int too large for a float
        return False

def _as_tuple(x: object, field: str) -> tuple:
    try:
        return tuple(x)
    except TypeError:
        raise ValueError(f"invalid SamplingParams: {field} must be a sequence, got {x!r}") from None

@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """vLLM-style sampling parameters. temperature 0 is greedy; top_k 0 and top_p 1 disable them.

    seed None (the default) means a fresh seed per request, as in vLLM: two unseeded requests
    draw independent noise. The engine fixes it when the request is created
    (`with_resolved_seed`) and reports it on the output; an explicit seed reproduces.
    Numeric fields take Python or numpy numbers (stored as Python int / float), never bools.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            object.__setattr__(self, "stop", _as_tuple(self.stop, "stop"))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids"))
        problems = []
        if not (_real(self.temperature) and _finite(self.temperature) and self.temperature >= 0):
            problems.append(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (_real(self.top_p) and 0 < self.top_p <= 1):
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (is_integer(self.top_k) and self.top_k >= 0):
            problems.append(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if not (is_integer(self.max_tokens) and self.max_tokens >= 1):
            problems.append(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not (self.seed is None or (is_integer(self.seed) and 0 <= self.seed < 2**32)):
            problems.append(f"seed must be None (a fresh seed per request) or an int in "
                            f"[0, 2**32), got {self.seed!r}")
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            problems.append(f"stop must be non-empty strings, got {self.stop!r}")
        if not all(is_integer(t) and t >= 0 for t in self.stop_token_ids):
            problems.append(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            problems.append(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))
        # Plain Python values, so params hash, compare and serialize alike however they were
        # spelled (np.int64(5) == 5, but json.dumps rejects it).
        for name in ("top_k", "max_tokens") + (("seed",) if self.seed is not None else ()):
            object.__setattr__(self, name, int(getattr(self, name)))
        for name in ("temperature", "top_p"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_resolved_seed(self) -> "SamplingParams":
        """These params with a concrete seed: itself when seeded, else a copy with a fresh
        32-bit seed from the OS's entropy (not `random`, whose state a user may have seeded)."""
        if self.seed is not None:
            return self
        return dataclasses.replace(self, seed=secrets.randbits(32))
