"""Collectives in a compiled program, read from its optimized HLO text: how a sharding regression
shows (an all-gather where none belongs), and what a step communicates."""

from __future__ import annotations

import dataclasses
import re

import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
# `%name = f32[1,576]{1,0} all-reduce(...)`, or a tuple of results `(f32[..], f32[..])`; async
# pairs count once, by their -start.
_OP = re.compile(r"=\s*(\([^=]*?\)|\S+)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
# Async starts whose value holds their operand beside their result (an all-reduce-start's is its
# result alone).
_START_WITH_OPERAND = ("all-gather", "collective-permute")


@dataclasses.dataclass(frozen=True)
class Collectives:
    counts: dict[str, int]  # per kind
    bytes: dict[str, int]  # result bytes per kind, per device

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def collectives(hlo_text: str) -> Collectives:
    """Counts and result bytes of each kind of collective in `hlo_text` (a compiled program's
    `as_text()`)."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    sizes = dict.fromkeys(COLLECTIVES, 0)
    for line in hlo_text.splitlines():
        match = _OP.search(line)
        if match is None or "-done(" in line:
            continue
        result, kind = match.group(1), match.group(2)
        counts[kind] += 1
        if match.group(3) and kind in _START_WITH_OPERAND:
            # The -start's value is (operand, result[, contexts]): only the result is received.
            result = _tuple_elements(result)[1]
        for dtype, dims in _SHAPE.findall(result):
            shape = [int(d) for d in dims.split(",") if d]
            sizes[kind] += int(np.prod(shape)) * _DTYPE_BYTES.get(dtype, 4)
    return Collectives(counts, sizes)


def _tuple_elements(text: str) -> list[str]:
    """The top-level elements of an HLO tuple shape `(a, (b, c), d)`."""
    elements, depth, start = [], 0, 1
    for i, char in enumerate(text):
        if char in "({[":
            depth += 1
        elif char in ")}]":
            depth -= 1
        if (char == "," and depth == 1) or depth == 0:
            elements.append(text[start:i].strip())
            start = i + 1
        if depth == 0:
            break
    return elements
