"""Parsing an experiment's flags as its `__main__` would, for the tests of what it refuses."""

from __future__ import annotations

from typing import Any

import pytest
from absl import flags


def refusal(flag_values: Any, *argv: str) -> str:
    """absl's message refusing `argv` for `flag_values` at parse time (the test fails if the
    flags parse); the flags are reset either way, so the next test parses afresh."""
    try:
        with pytest.raises(flags.IllegalFlagValueError) as error:
            flag_values(["experiment", *argv])
    finally:
        flag_values.unparse_flags()
    return str(error.value)


def parses(flag_values: Any, *argv: str) -> None:
    """`argv` parses (every validator passes), the flags reset after."""
    try:
        flag_values(["experiment", *argv])
    finally:
        flag_values.unparse_flags()
