"""Jitted programs shared by every engine over weights of one signature.

Each `Engine` used to jit closures of its own, so a second engine over the same weights traced
and lowered every step program again (JAX's persistent compilation cache saves XLA's compile
only): seconds per engine on SmolLM2, for every point of a sweep that builds an engine per
setting, and most of the test suite's time. A `ProgramMemo` keeps sets of jitted programs keyed
by everything their traces read (`Binding.signature` and the settings a builder closes over), so
engines over equal keys call the same jitted functions and reuse the executables jit holds.

The memo is bounded by the executables its sets hold, not by their number: an XLA:CPU
executable keeps ~90-190 memory mappings of its code, and a process holding a few hundred
passes Linux's vm.max_map_count (65,530), where LLVM fails with "Cannot allocate memory" and the
process dies. Dropping a set only drops the memo's reference: engines alive keep theirs.

Module globals a trace reads (a kernel's tiling threshold, a function a test patches) are not in
any key: whoever changes one calls `PROGRAMS.clear()`, or later engines run programs traced
before the change.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable, Hashable, Protocol, TypeVar

import jax


class ProgramSet(Protocol):
    def executables(self) -> int:
        """The compiled executables its jitted functions hold (one per input signature run)."""
        ...


P = TypeVar("P", bound=ProgramSet)


def jit_on(fn: Callable, device: jax.sharding.Sharding | None, **options) -> Callable:
    """`jax.jit(fn, **options)`; with `device` (weights put there explicitly,
    `infer.model.binding.committed_device`) every input is taken there, so host arrays and the
    last step's committed outputs reach one executable instead of one per mix."""
    if device is not None:
        options["in_shardings"] = device
    return jax.jit(fn, **options)


def count_executables(*jitted: Callable) -> int:
    """Executables held by `jax.jit` functions: each one's cache of compiled signatures."""
    return sum(fn._cache_size() for fn in jitted)


class ProgramMemo:
    """Program sets by key, least recently used dropped first once their executables pass
    `max_executables` (checked whenever a set is asked for; the set asked for is kept). A set
    asked for that holds `max_executables` or more itself (engines of many shapes over one
    model: a sweep) is built anew: engines alive keep the full one, and it goes with them."""

    def __init__(self, max_executables: int) -> None:
        if max_executables < 1:
            raise ValueError(f"max_executables must be positive, got {max_executables}")
        self.max_executables = max_executables
        self._sets: collections.OrderedDict[Hashable, ProgramSet] = collections.OrderedDict()
        self._lock = threading.Lock()  # the server builds engines on its worker thread

    def get(self, key: Hashable, build: Callable[[], P]) -> P:
        """The set under `key`, built by `build()` the first time (or after it was dropped)."""
        with self._lock:
            programs = self._sets.pop(key, None)
            if programs is None or programs.executables() >= self.max_executables:
                programs = build()
            self._sets[key] = programs
            self._trim()
            return programs

    def _trim(self) -> None:
        held = self.executables()
        while held > self.max_executables and len(self._sets) > 1:
            _, dropped = self._sets.popitem(last=False)
            held -= dropped.executables()

    def executables(self) -> int:
        return sum(p.executables() for p in self._sets.values())

    def clear(self) -> None:
        with self._lock:
            self._sets.clear()

    def __len__(self) -> int:
        return len(self._sets)


# The process's memo. 64 executables: a default SmolLM2 serving run's step programs (30) twice
# over, at ~12k of the 65,530 mappings a process may hold.
PROGRAMS = ProgramMemo(max_executables=64)
